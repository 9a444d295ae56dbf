"""Work checks: what a call computes that nobody asked for, read from its matmul FLOPs
(`harness.meters.matmul_flops`), compared with the same call where every input is trainable."""
from __future__ import annotations

from typing import cast

from harness.cases.case import LinearCase
from harness.checks import Evidence, check


@check("frozen-input-work", evidence=("matmul-work",),
       applies=lambda c, t: c.T > 0 and c.requires_grad and c.frozen != "none" and c.context == "train",
       reads=("work",))
def frozen_input_work(ev: Evidence) -> list[str]:
    """A frozen input's gradient is not computed. Either input's gradient is a product of
    2*T*V_local*H floating-point operations on each rank (the weight shard's dlogits^T @ hidden,
    the hidden states' dlogits @ weight): with one input frozen (a LoRA run's LM head, a frozen
    trunk) the call, forward and backward together, must run at least half of that fewer matmul
    FLOPs than the same call with both inputs trainable (each counted in a call of its own,
    `executor.frozen_and_trainable_work`). A routine that allocates and accumulates the frozen
    input's gradient and lets autograd drop it (prime-rl before its #3011) fails. Judged only where
    the trainable call's counted matmuls cover its forward logits and both gradients
    (6*T*V_local*H): a routine whose products run outside torch's matmul ops (its own kernels,
    elementwise sums) leaves nothing to compare."""
    c = cast(LinearCase, ev.case)  # evidence "matmul-work": this level's cases
    one_product = 2 * c.T * c.v_local * c.H
    problems = []
    for r in range(len(ev.ranks)):
        frozen, both = ev.obs(r).work or (None, None)
        if frozen is None or both is None or both < 3 * one_product:
            continue
        if both - frozen < one_product // 2:
            problems.append(f"{ev.ranks[r].name}: {frozen:,} matmul FLOPs with the {c.frozen} frozen, {both:,} with "
                            f"both inputs trainable: {both - frozen:,} fewer, where not computing the frozen "
                            f"{c.frozen}'s gradient saves {one_product:,} (2*T*V_local*H; at least half required)")
    return problems
