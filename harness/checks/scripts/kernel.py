"""The kernel level's stand-alone scripts (`KERNEL_SCRIPT`): one rank's shard of the logits handed to
`calculate_log_probs_and_entropy`, judged against `reference/kernel.py`'s float64 answer.

Named for its level, as `checks/kernel.py` judges it and `reference/kernel.py` is its oracle: a level
keeps one module name across the layers. The token levels' shared judging (`TOKEN_JUDGES`: the
values, the finiteness of every output) is here; `scripts/linear.py` reuses it with its own
reference.
"""
from __future__ import annotations

from typing import Any

from harness.cases.case import KernelCase
from harness.checks.scripts import LevelScript
from harness.reference import kernel as reference

# Script code shared by the token levels: the upstream loss, where a wrong gradient sits, and the
# judging of their outputs (each level's `reference_outputs(x)` is its float64 answer, its
# `grad_pairs(results, x)` its gradients next to theirs).
TOKEN_CODE = '''
def weighted(out, w):
    """sum(w * out): the upstream loss's term of one output; 0.0 when the output is not in the loss or
    carries no gradient (a metric-only entropy)."""
    if w is None or not torch.is_tensor(out) or not out.requires_grad:
        return 0.0
    return (out.reshape(-1) * w.to(out.dtype)).sum()


def off_ranks(got, want, bound):
    """The ranks whose vocab shard holds an entry outside its bound (VOCAB_DIM: the vocab's dimension)."""
    b = bound.clamp_min(1e-300)
    outside = ~torch.isclose(got.to(torch.float64) / b, want / b, rtol=0.0, atol=1.0)
    return sorted({int(i) // CASE.v_local for i in outside.nonzero()[:, VOCAB_DIM].tolist()})
'''

TOKEN_JUDGES = {
    "values": '''
def judge(results):
    """The log-probs and the entropy each rank returns, against the float64 values of the same inputs."""
    log_prob, ent = reference_outputs(inputs(CASE))
    problems = []
    for rank, r in enumerate(results):
        if TERM in ("", "log-prob"):
            problems += compare(r["log_prob"], log_prob, LOG_PROB_TOL, f"rank {rank} log_prob")[0]
        if TERM in ("", "entropy") and CASE.with_entropy:
            problems += compare(r["entropy"], ent, ENTROPY_TOL, f"rank {rank} entropy")[0]
    return problems
''',
    "finite": '''
def judge(results):
    """NaN or inf in the outputs or the gradient where the float64 answer is finite."""
    x = inputs(CASE)
    log_prob, ent = reference_outputs(x)
    pairs = [(f"rank {rank} {key}", r[key], want) for rank, r in enumerate(results)
             for key, want in (("log_prob", log_prob), ("entropy", ent)) if TERM in ("", key.replace("_", "-"))]
    return [p for name, got, want in pairs + grad_pairs(results, x) for p in nonfinite(name, got, want)]
''',
}

KERNEL_CODE = TOKEN_CODE + '''

EXEMPT = ()
VOCAB_DIM = -1


def run(routine, rank, group):
    """This rank's shard of the logits (and of the keep mask), a fresh leaf that requires grad as the
    caller's does; one call, and the backward of sum(w1 * log_prob) + sum(w2 * entropy)."""
    x = inputs(CASE)
    cols = slice(rank * CASE.v_local, (rank + 1) * CASE.v_local)
    logits = x.logits[:, cols].clone().requires_grad_(CASE.requires_grad)
    mask = None if x.keep_mask is None else x.keep_mask[:, cols].clone()
    with phase("forward"):
        log_prob, ent = routine(logits, x.tokens.clone(), group, with_entropy=CASE.with_entropy,
                                chunk_size=CASE.chunk_size, log_prob_keep_mask=mask,
                                with_entropy_grad=CASE.with_entropy_grad)
    loss = weighted(log_prob, x.w_log_prob) + weighted(ent, x.w_entropy)
    with phase("backward"):
        if torch.is_tensor(loss):
            loss.backward()
    return {"log_prob": detached(log_prob), "entropy": detached(ent), "grad": logits.grad}


def reference_outputs(x):
    return log_probs(x.logits, x.tokens, x.keep_mask), entropy(x.logits)


def reference_grad(x):
    """The float64 gradient of the loss w.r.t. the whole [T, V] logits (the entropy's term only where
    the entropy is differentiable)."""
    return logits_grad(x.logits, x.tokens, x.keep_mask, x.w_log_prob,
                       x.w_entropy if CASE.expects_entropy_grad else None)


def grad_pairs(results, x):
    if not CASE.grad_on or any(r["grad"] is None for r in results):
        return []
    return [("grad (all shards)", torch.cat([r["grad"] for r in results], dim=-1), reference_grad(x))]
'''

KERNEL_JUDGES = {**TOKEN_JUDGES, "gradients": '''
def judge(results):
    """The gradient of sum(w1 * log_prob) (+ sum(w2 * entropy) when the entropy is in the loss) with
    respect to the logits, gathered from every rank's shard, against the float64 gradient of the same loss."""
    if any(r["grad"] is None for r in results):
        return ["no gradient reached the logits (log_prob is not differentiable)"]
    got, want = torch.cat([r["grad"] for r in results], dim=-1), reference_grad(inputs(CASE))
    problems = compare(got, want, GRAD_TOL, "grad (all shards)")[0]
    if problems and TP > 1:
        problems.append(f"outside the bound in the shards of rank(s) {off_ranks(got, want, GRAD_TOL)}")
    return problems
'''}


def refuse(case: Any) -> str | None:
    if (case.layout, case.token_layout) != ("contiguous", "contiguous"):
        return "scripts hand over contiguous logits and tokens (layout, token_layout at their defaults)"
    if case.batch_of:
        return "scripts draw a case's own rows (batch_of=0)"
    return None


KERNEL_SCRIPT = LevelScript(
    checks=("values", "gradients", "finite", "crash", "empty-input", "memory-logits-dtype"),
    code=KERNEL_CODE,
    judges=KERNEL_JUDGES,
    uses={"inputs": KernelCase.inputs, "log_probs": reference.log_probs, "entropy": reference.entropy,
          "logits_grad": reference.logits_grad},
    bounds={"LOG_PROB_TOL": "log_prob_tol", "ENTROPY_TOL": "entropy_tol", "GRAD_TOL": "grad_tol"},
    refuse=refuse,
    alone=("gradients",),
)
