"""megatron-core's fused `fused_vocab_parallel_cross_entropy` as a log-prob-only kernel target.

The variant Megatron uses under `--cross-entropy-loss-fusion`: the same math as
`vocab_parallel_cross_entropy` in `torch.jit.script`-ed pieces, with one all-reduce for the target
logit and the sum of exponentials together, and an explicit `tp_group` argument (the harness's
group is passed as is). It runs on CPU. Like the unfused one it computes no entropy and takes no
keep mask, and `chunk_size` is accepted and ignored. The adapter hands over the caller's tensor.

Its pieces are compiled: megatron-core's `jit_fuser` is `torch.compile` on torch >= 2.2. So the
target declares `"eager": False`: under the memory meter's dispatch mode Dynamo would run them
eagerly, a path production does not take, so the memory checks say "not applied"; and each
signature compiles once, statically, as in a process of its own, so that whether a piece runs a
static, a dynamic-shape or (past torch's recompile limit) no compiled graph never depends on
earlier cases (`compile_per_signature`).
`harness peers` checks it at the `smoke` profile: every case compiles its pieces (from Inductor's
cache, once warm) on every rank, and its Python is the unfused `megatron`'s, checked at `ci`.
"""
from __future__ import annotations

import dataclasses

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers import megatron as unfused

HARNESS = Declaration(
    capabilities={"entropy": False, "keep_mask": False, "eager": False},
    peer=PeerInfo(requires=("megatron.core",), install="pip install megatron-core (a harness dependency)",
                  upstream=("megatron.core.fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy",),
                  profile="smoke"),
    # What megatron-core's own caller makes: GPTModel's loss on the output layer's logits, as for the
    # unfused cross entropy (the `megatron` adapter), under `cross_entropy_loss_fusion`.
    use=unfused.HARNESS.use,
)


def megatron_fused_kernel(fce, logits, tokens, tp_group):
    """megatron-core's call under `--cross-entropy-loss-fusion`: `fused_vocab_parallel_cross_entropy`
    (of `fce`, `megatron.core.fusions.fused_cross_entropy`) on the caller's logits with the TP group
    as its argument; the log-prob is minus the loss. Needs only torch and megatron-core (its pieces
    compile with torch.compile, as in production): `harness repro --script` embeds it."""
    return -fce.fused_vocab_parallel_cross_entropy(logits, tokens.reshape(-1).long(), tp_group), None


# `harness repro --script`: megatron-core's module, imported as installed, and the call.
HARNESS = dataclasses.replace(HARNESS, script={
    "name": "megatron-core", "files": {"fce": "megatron.core.fusions.fused_cross_entropy"},
    "kernel": megatron_fused_kernel, "how": "pip install megatron-core (the script imports it as installed)"})


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    """Level 1 kernel over megatron-core's fused cross entropy: `(log_prob [T] float32, None)`."""
    from megatron.core.fusions import fused_cross_entropy

    if with_entropy or log_prob_keep_mask is not None:
        raise NotImplementedError("megatron's fused cross entropy computes no entropy and takes no keep mask "
                                  "(HARNESS_CAPABILITIES)")
    return megatron_fused_kernel(fused_cross_entropy, logits, tokens.to(device=logits.device), tp_group)
