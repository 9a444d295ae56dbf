"""Apple's Cut Cross-Entropy, vocab-parallel: `linear_cross_entropy(..., impl="torch_compile",
vocab_parallel_options=VocabParallelOptions(start, stop, group))`, as a log-prob-only fused-linear
target that is tensor-parallel on its own.

Each rank passes its shard of the classifier, `c [V_local, H]`, with the range of the vocabulary it
holds and the TP group (the harness's, megatron-core's `parallel_state` group, passed as the
argument the library takes; the README's form: `VocabParallelOptions(vp_start, vp_stop,
group=vp_group)`). Under it `torch_compile_linear_cross_entropy` hands the call to
`cut_cross_entropy.vocab_parallel.vocab_parallel_torch_compile_lce_apply` (`torch.compile`,
`fullgraph=True`): the shard's logits `e @ c.T` in the inputs' dtype, a float32 log-sum-exp per
shard, combined over the group by two all-reduces (max, then sum of exponentials:
`vp_reduce_lse`), the target's logit from the rank that holds it summed over the group
(`vp_reduce_correct_logit`), and, from #42 on, the hidden states' gradient all-reduced in float32
(`vp_reduce_e_grad_hook`, `reduce_e_grad=True` by default). It computes no entropy; `log_prob =
-loss` (`reduction="none"`); `chunk_size` is ignored. At TP 1 the same path runs over a group of one.

The vocab-parallel path is in the repository from #38 (`498c3ce`, April 2025) and in no release on
PyPI: cut-cross-entropy 25.1.1 has no `cut_cross_entropy.vocab_parallel`, so the adapter runs on a
tree of the repository on `PYTHONPATH` (`git clone https://github.com/apple/ml-cross-entropy`), and
is "not here" without one. Like `cce` it declares `"eager": False` (the memory checks say "not
applied"), each signature compiles once, as in a process of its own (`compile_per_signature`), and
`harness peers` checks it at the `smoke` profile.
"""
from __future__ import annotations

import dataclasses

import torch

from harness.targets.declaration import Declaration, PeerInfo

# torch.compile(fullgraph=True) raises under a Python dispatch mode: the memory meter stays off.
HARNESS = Declaration(
    capabilities={"entropy": False, "eager": False},
    peer=PeerInfo(
        requires=("cut_cross_entropy",),
        install=("a tree of https://github.com/apple/ml-cross-entropy on PYTHONPATH (the vocab-parallel "
                 "path is in no release: cut-cross-entropy 25.1.1 lacks it)"),
        # Only the vocab-parallel function is named: the installed 25.1.1 defines `linear_cross_entropy`
        # too, and would make the adapter look runnable where its path is missing.
        upstream=("cut_cross_entropy.vocab_parallel.vocab_parallel_torch_compile.vocab_parallel_torch_compile_lce_apply "
                  "(through linear_cross_entropy(impl='torch_compile', vocab_parallel_options=...))",),
        profile="smoke"),
    # A library: no trainer of its own calls it here, so nothing is declared beyond its use (every case
    # drawn is taken as in its use; a trainer that adopts it declares its own).
    use=[],
)


def cce_vocab_parallel_linear(cce, hidden, weight, tokens, tp_group):
    """Cut Cross-Entropy's vocab-parallel call (`cce`: `cut_cross_entropy`), as its README shows it:
    this rank's classifier shard, the range `[start, stop)` of the vocabulary it holds (rank r holds
    rows r*V_local to (r+1)*V_local) and the group, per token, the `torch_compile` implementation; the
    log-prob is minus the loss. Needs only torch and `cce`: `harness repro --script` embeds it."""
    rank, v_local = torch.distributed.get_rank(tp_group), weight.shape[0]
    options = cce.VocabParallelOptions(rank * v_local, (rank + 1) * v_local, group=tp_group)
    tokens = tokens.reshape(-1).to(device=hidden.device, dtype=torch.long)
    return -cce.linear_cross_entropy(hidden, weight, tokens, reduction="none", impl="torch_compile",
                                     vocab_parallel_options=options), None


# `harness repro --script`: the library, imported from the tree on PYTHONPATH, and the call.
HARNESS = dataclasses.replace(HARNESS, script={
    "name": "Cut Cross-Entropy (vocab-parallel)", "files": {"cce": "cut_cross_entropy"},
    "linear": cce_vocab_parallel_linear,
    "how": "git clone https://github.com/apple/ml-cross-entropy (TREE: the clone; 25.1.1 lacks the path)"})


def calculate_linear_log_probs_and_entropy(hidden, weight, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                           with_entropy_grad=True):
    """Fused-linear level over Cut Cross-Entropy's vocab-parallel path: `(log_prob [T] float32, None)`."""
    import cut_cross_entropy

    if with_entropy:
        raise NotImplementedError("Cut Cross-Entropy computes no entropy (HARNESS_CAPABILITIES['entropy'] is False)")
    return cce_vocab_parallel_linear(cut_cross_entropy, hidden, weight, tokens, tp_group)
