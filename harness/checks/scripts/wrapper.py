"""The wrapper level's stand-alone scripts (`WRAPPER_SCRIPT`): one rank's shard of a packed batch's
logits handed to slime's `get_log_probs_and_entropy` with an `args` namespace, each sample's tokens
and top-p replay, judged per sample against `reference/wrapper.py`'s float64 answer.

Named for its level, as `checks/wrapper.py` judges it and `reference/wrapper.py` is its oracle: a
level keeps one module name across the layers.
"""
from __future__ import annotations

from typing import Any

from harness.cases.case import WrapperCase
from harness.checks.scripts import LevelScript
from harness.reference import wrapper as reference

WRAPPER_CODE = '''
EXEMPT = ()


def weighted(values, weights):
    """The loss's term of one output: sum over the samples of sum(w * value), for the values that carry
    a gradient and have one weight each (a wrong count is the judge's to report)."""
    terms = [(v.reshape(-1) * w.to(v.dtype)).sum() for v, w in zip(values or [], weights)
             if torch.is_tensor(v) and v.requires_grad and v.numel() == w.numel()]
    return sum(terms, 0.0)


def run(routine, rank, group):
    """This rank's shard of the packed logits, [1, T, V_local] as the model returns them, with slime's
    args, every sample's tokens and the recorded nucleus; one call, and the backward of the loss
    over the response positions (the entropy's term wherever the entropy carries a gradient)."""
    x = inputs(CASE)
    logits = x.logits[:, rank * CASE.v_local:(rank + 1) * CASE.v_local].clone().requires_grad_(True)
    with phase("forward"):
        _, res = routine(logits.unsqueeze(0), args=case_args(CASE), unconcat_tokens=x.unconcat_tokens,
                         total_lengths=list(CASE.total_lengths), response_lengths=list(CASE.response_lengths),
                         with_entropy=CASE.with_entropy, top_p_token_ids=x.top_p_token_ids,
                         top_p_token_offsets=x.top_p_token_offsets)
    log_probs, ent = res.get("log_probs"), res.get("entropy")
    loss = weighted(log_probs, x.w_log_probs) + weighted(ent, x.w_entropy)
    with phase("backward"):
        if torch.is_tensor(loss):
            loss.backward()
    return {"log_probs": None if log_probs is None else [detached(t) for t in log_probs],
            "entropy": None if ent is None else [detached(t) for t in ent], "grad": logits.grad,
            "entropy_requires_grad": [t.requires_grad for t in ent or [] if torch.is_tensor(t)]}


def reference_outputs():
    x = inputs(CASE)
    return wrapper_outputs(x.logits, case_args(CASE), x.unconcat_tokens, list(CASE.total_lengths),
                           list(CASE.response_lengths), CASE.with_entropy, x.top_p_token_ids, x.top_p_token_offsets)


def per_sample(rank, got, want, bounds, key):
    """One rank's per-sample values of one output: one float32 tensor of R_i values per sample, each
    within its bounds."""
    if got is None or len(got) != len(want):
        return [f"rank {rank}: {0 if got is None else len(got)} {key} entries for {len(want)} samples"]
    problems = []
    for i, (g, w, b) in enumerate(zip(got, want, bounds)):
        if torch.is_tensor(g) and g.dtype != torch.float32:
            problems.append(f"rank {rank}: {key}[{i}] dtype {g.dtype}, expected float32")
        problems += compare(g, w, b, f"rank {rank} sample {i} {key}")[0]
    return problems
'''

# The checks that judge the per-sample values: the log-probs (wrapper-extraction), the entropy
# (wrapper-entropy), both at a temperature or under top-p replay.
VALUES = '''
def judge(results):
    """Each sample's response log-probs and entropies, as each rank returns them, against the float64
    values of the same inputs: the logits divided by args.rollout_temperature, the targets shifted
    (row j of a sample predicts its token j + 1), the recorded nucleus replayed for the log-probs only."""
    want = reference_outputs()
    problems = []
    for rank, r in enumerate(results):
        if CHECK != "wrapper-entropy" and TERM in ("", "log-prob"):
            problems += per_sample(rank, r["log_probs"], want["log_probs"], LOG_PROB_TOL, "log_probs")
        if CHECK != "wrapper-extraction" and TERM in ("", "entropy") and CASE.with_entropy:
            problems += per_sample(rank, r["entropy"], want["entropy"], ENTROPY_TOL, "entropy")
    return problems
'''

WRAPPER_JUDGES = {check: VALUES for check in ("wrapper-extraction", "wrapper-entropy", "temperature", "top-p-replay")}
WRAPPER_JUDGES["wrapper-gradients"] = '''
def judge(results):
    """The gradient w.r.t. the raw logits, gathered from every rank's shard, against the float64
    gradient of the loss over the response positions, the entropy's term included exactly when
    entropy_coef != 0 (slime PR #2153)."""
    if any(r["grad"] is None for r in results):
        return ["no gradient reached the logits"]
    x = inputs(CASE)
    want = wrapper_logits_grad(x.logits, case_args(CASE), x.unconcat_tokens, list(CASE.total_lengths),
                               list(CASE.response_lengths), CASE.with_entropy, x.w_log_probs, x.w_entropy,
                               x.top_p_token_ids, x.top_p_token_offsets)
    got = torch.cat([r["grad"] for r in results], dim=-1)
    problems = compare(got, want, GRAD_TOL, "grad (all shards)")[0]
    if problems and TP > 1:
        problems.append(f"outside the bound in the shards of rank(s) {off_ranks(got, want, GRAD_TOL)}")
    return problems


def off_ranks(got, want, bound):
    """The ranks whose vocab shard holds an entry outside its bound."""
    b = bound.clamp_min(1e-300)
    outside = ~torch.isclose(got.to(torch.float64) / b, want / b, rtol=0.0, atol=1.0)
    return sorted({int(i) // CASE.v_local for i in outside.nonzero()[:, -1].tolist()})
'''
WRAPPER_JUDGES["entropy-coef-rule"] = '''
def judge(results):
    """slime PR #2153: the entropy is differentiable exactly when entropy_coef != 0 (absent and -0.0 are
    zero; a negative coefficient is a coefficient), whoever calls the wrapper."""
    want = entropy_grad_rule(CASE.with_entropy, case_args(CASE))
    if any("error" in r for r in results):  # a caller that never sets entropy_coef is a caller too
        return [f"rank {rank}: the wrapper raised with entropy_coef absent (absent means 0): {r['error']}"
                for rank, r in enumerate(results) if "error" in r][:1] if CASE.entropy_coef is None else []
    return [f"rank {rank}: entropy[{i}].requires_grad={flag} with entropy_coef={CASE.entropy_coef!r}; expected {want}"
            for rank, r in enumerate(results) for i, flag in enumerate(r["entropy_requires_grad"]) if flag != want][:1]
'''


def refuse(case: Any) -> str | None:
    if (case.layout, case.token_layout) != ("contiguous", "contiguous"):
        return "scripts hand over contiguous logits and tokens (layout, token_layout at their defaults)"
    if case.cp > 1:
        return "scripts run one TP group without context parallelism (cp=1)"
    return None


WRAPPER_SCRIPT = LevelScript(
    checks=("wrapper-extraction", "wrapper-entropy", "temperature", "top-p-replay", "wrapper-gradients",
            "entropy-coef-rule", "crash", "memory-logits-dtype"),
    code=WRAPPER_CODE,
    judges=WRAPPER_JUDGES,
    uses={"inputs": WrapperCase.inputs, "case_args": WrapperCase.args, "wrapper_outputs": reference.wrapper_outputs,
          "wrapper_logits_grad": reference.wrapper_logits_grad, "entropy_grad_rule": reference.entropy_grad_rule},
    bounds={"LOG_PROB_TOL": "log_prob_tol", "ENTROPY_TOL": "entropy_tol", "GRAD_TOL": "grad_tol"},
    refuse=refuse,
    alone=("wrapper-gradients",),
    raising=("entropy-coef-rule",),
    parallel_state=True,
)
