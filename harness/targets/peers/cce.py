"""Apple's Cut Cross-Entropy, `linear_cross_entropy(..., impl="torch_compile")`, as a log-prob-only
fused-linear target.

`cut_cross_entropy.linear_cross_entropy(e, c, targets, reduction="none", impl=...)` takes the
hidden states `e [T, H]` and the classifier `c [V, H]` and returns the per-token loss. Its `cce`
implementation is Triton (CUDA only); its `torch_compile` one, checked here, is `F.cross_entropy`
of `(e @ c.T).float()` under `torch.compile`, which runs on CPU. It computes no entropy, and it is
not tensor-parallel: at TP > 1 the adapter all-gathers the weight's vocab shards
(`_mpu.gather_vocab`), so every rank computes the full answer. `log_prob = -loss`; `chunk_size`
is ignored. Its `fullgraph=True` compile raises under any Python dispatch mode, so the target
declares `"eager": False`: the harness runs it without the memory meter, and the memory checks
say "not applied" and why; and each signature compiles once, statically, as in a process of its
own, so that no case is judged by the compilations earlier cases left in its worker
(`compile_per_signature`).

`harness peers` checks it at the `smoke` profile: each case compiles (from Inductor's cache, once
warm), and the routine has few of the dimensions `ci`'s extra draws vary (no entropy, no
tensor parallelism of its own); the corpus's fused-linear cases, bf16 and the deep regime
included, run at every profile.
"""
from __future__ import annotations

import dataclasses

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._mpu import gather_vocab

# torch.compile(fullgraph=True) raises under a Python dispatch mode: the memory meter stays off.
HARNESS = Declaration(
    capabilities={"entropy": False, "eager": False, "tensor_parallel": False},
    peer=PeerInfo(requires=("cut_cross_entropy",), install="pip install cut-cross-entropy",
                  upstream=("cut_cross_entropy.linear_cross_entropy (impl='torch_compile')",), profile="smoke"),
    # A library: no trainer of its own calls it here, so nothing is declared beyond its use (every case
    # drawn is taken as in its use; a trainer that adopts it declares its own).
    use=[],
)


def cce_linear(cce, hidden, weight, tokens):
    """Cut Cross-Entropy's call: `linear_cross_entropy` (of `cce`, `cut_cross_entropy`) of the hidden
    states and the whole classifier, per token, its `torch_compile` implementation (the one that runs
    on CPU); the log-prob is minus the loss. Needs only torch and `cce`: `harness repro --script` embeds it."""
    tokens = tokens.reshape(-1).to(device=hidden.device, dtype=torch.long)
    return -cce.linear_cross_entropy(hidden, weight, tokens, reduction="none", impl="torch_compile"), None


# `harness repro --script`: the library, imported as installed, and the call (TP 1 only: Cut Cross-Entropy is
# not tensor-parallel, and at TP > 1 the adapter, not the library, gathers the classifier's shards).
HARNESS = dataclasses.replace(HARNESS, script={"name": "Cut Cross-Entropy", "files": {"cce": "cut_cross_entropy"},
                                               "linear": cce_linear, "how": "pip install cut-cross-entropy"})


def calculate_linear_log_probs_and_entropy(hidden, weight, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                           with_entropy_grad=True):
    """Fused-linear level over Cut Cross-Entropy: `(log_prob [T] float32, None)`."""
    import cut_cross_entropy

    if with_entropy:
        raise NotImplementedError("Cut Cross-Entropy computes no entropy (HARNESS_CAPABILITIES['entropy'] is False)")
    return cce_linear(cut_cross_entropy, hidden, gather_vocab(weight, tp_group, dim=0), tokens)
