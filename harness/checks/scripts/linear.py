"""The fused-linear level's stand-alone scripts (`LINEAR_SCRIPT`): the hidden states and one rank's
rows of the LM head handed to `calculate_linear_log_probs_and_entropy`, judged against
`reference/linear.py`'s float64 answer.

Named for its level, as `reference/linear.py` is its oracle and `targets/mutants/linear.py` breaks
it: a level keeps one module name across the layers. It judges its outputs as `scripts/kernel.py`
does (`TOKEN_JUDGES`), with its own reference and gradients.
"""
from __future__ import annotations

from typing import Any

from harness.cases.case import LinearCase
from harness.checks.scripts import LevelScript
from harness.checks.scripts.kernel import TOKEN_CODE, TOKEN_JUDGES
from harness.meters.matmul_flops import Work
from harness.reference import linear as reference

LINEAR_CODE = TOKEN_CODE + '''

EXEMPT = (CASE.H,)  # a float32 copy of an input, or its gradient, is the allowance's, not the logits'
VOCAB_DIM = 0


def call(routine, rank, group, frozen):
    """The whole hidden states and this rank's rows of the LM head, each a fresh leaf that requires
    grad unless `frozen`; one call, and the backward of sum(w1 * log_prob) + sum(w2 * entropy)."""
    x = inputs(CASE)
    hidden = x.hidden.clone().requires_grad_(CASE.requires_grad and frozen != "hidden")
    weight = x.weight[rank * CASE.v_local:(rank + 1) * CASE.v_local].clone()
    weight.requires_grad_(CASE.requires_grad and frozen != "weight")
    with phase("forward"):
        log_prob, ent = routine(hidden, weight, x.tokens.clone(), group, with_entropy=CASE.with_entropy,
                                chunk_size=CASE.chunk_size, with_entropy_grad=CASE.with_entropy_grad)
    loss = weighted(log_prob, x.w_log_prob) + weighted(ent, x.w_entropy)
    with phase("backward"):
        if torch.is_tensor(loss):
            loss.backward()
    return {"log_prob": detached(log_prob), "entropy": detached(ent), "grad": weight.grad, "grad_hidden": hidden.grad}


def run(routine, rank, group):
    return call(routine, rank, group, CASE.frozen)


def reference_outputs(x):
    return linear_log_probs(x.hidden, x.weight, x.tokens), linear_entropy(x.hidden, x.weight)


def reference_grads(x):
    """The float64 gradients of the loss: w.r.t. the hidden states [T, H] and the whole head [V, H]."""
    grads = linear_grads(x.hidden, x.weight, x.tokens, x.w_log_prob, x.w_entropy if CASE.expects_entropy_grad else None)
    return grads[0], grads[1]


def grad_pairs(results, x):
    if not CASE.grad_on:
        return []
    hidden, weight = reference_grads(x)
    pairs = [(f"rank {rank} hidden grad", r["grad_hidden"], hidden) for rank, r in enumerate(results)]
    if all(r["grad"] is not None for r in results):
        pairs.append(("weight grad (all shards)", torch.cat([r["grad"] for r in results]), weight))
    return pairs
'''

LINEAR_JUDGES = {**TOKEN_JUDGES, "gradients": '''
def judge(results):
    """The gradients of sum(w1 * log_prob) (+ sum(w2 * entropy) when the entropy is in the loss) with
    respect to every input the caller trains: the LM head's, gathered from every rank's rows, and the
    hidden states' on every rank, against the float64 gradients of the same loss."""
    hidden, weight = reference_grads(inputs(CASE))
    problems = []
    if CASE.weight_grad:
        if any(r["grad"] is None for r in results):
            problems.append("no gradient reached the weight shard")
        else:
            got = torch.cat([r["grad"] for r in results])
            problems += compare(got, weight, GRAD_TOL, "weight grad (all shards)")[0]
            if problems and TP > 1:
                problems.append(f"outside the bound in the rows of rank(s) {off_ranks(got, weight, GRAD_TOL)}")
    if CASE.hidden_grad:
        for rank, r in enumerate(results):
            if r["grad_hidden"] is None:
                problems.append(f"rank {rank}: no gradient reached the hidden states")
            else:
                problems += compare(r["grad_hidden"], hidden, GRAD_HIDDEN_TOL, f"rank {rank} hidden grad")[0]
    return problems
''', "frozen-input-work": '''
def run(routine, rank, group):
    """The call's matmul FLOPs, forward and backward (the harness's counter), with the input frozen
    and with both trainable, each a call of its own."""
    counts = []
    for frozen in (CASE.frozen, "none"):
        work = Work()
        with work.counting():
            call(routine, rank, group, frozen)
        counts.append(work.total)
    return {"work": counts}


def judge(results):
    """With one input frozen (a LoRA run's LM head), the call, forward and backward, runs at least half
    of one gradient product (2*T*V_local*H FLOPs) fewer matmul FLOPs than with both inputs trainable:
    the frozen input's gradient is not computed."""
    one_product = 2 * CASE.T * CASE.v_local * CASE.H
    problems = []
    for rank, r in enumerate(results):
        frozen, both = r["work"]
        if frozen is None or both is None or both < 3 * one_product:
            continue
        if both - frozen < one_product // 2:
            problems.append(f"rank {rank}: {frozen:,} matmul FLOPs with the {CASE.frozen} frozen, {both:,} with both "
                            f"inputs trainable: {both - frozen:,} fewer, where not computing the frozen "
                            f"{CASE.frozen}'s gradient saves {one_product:,} (2*T*V_local*H; at least half required)")
    return problems
'''}


def refuse(case: Any) -> str | None:
    if case.hidden_view != "contiguous":
        return "scripts hand over contiguous hidden states (hidden_view=contiguous)"
    return None


LINEAR_SCRIPT = LevelScript(
    checks=("values", "gradients", "finite", "crash", "empty-input", "frozen-input-work", "memory-logits-dtype"),
    code=LINEAR_CODE,
    judges=LINEAR_JUDGES,
    uses={"inputs": LinearCase.inputs, "linear_log_probs": reference.linear_log_probs,
          "linear_entropy": reference.linear_entropy, "linear_grads": reference.linear_grads, "Work": Work},
    bounds={"LOG_PROB_TOL": "log_prob_tol", "ENTROPY_TOL": "entropy_tol", "GRAD_TOL": "grad_tol",
            "GRAD_HIDDEN_TOL": "grad_hidden_tol"},
    refuse=refuse,
    alone=("gradients",),
)
