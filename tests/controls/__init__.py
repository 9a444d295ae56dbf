"""No-false-finding controls: independent, correct float32 implementations of the contract.

Each module exports `calculate_log_probs_and_entropy` (Level 1) and `get_log_probs_and_entropy`
(Level 2, the shared wrapper of `_wrapper.make_wrapper` bound to that module's kernel), so
`python -m harness check --target tests.controls.NAME` must report no finding on any of them.
Every one uses a different algorithm, and none the built-in routine's (harness/targets/fused.py:
max-shifted exponentials, one stacked MAX and one stacked SUM all-reduce per chunk, a saved float32
softmax):

- `unshifted`: entropy = lse - sum(p * x) on unshifted logits; two stacked all-reduces per chunk
  (MAX, SUM); saves no [T, V_local] tensor, backward recomputes from the logits and lse.
- `online`: flash-style streaming softmax over vocab blocks of the shard (running max, rescaled
  sums), per-rank states all-gathered and merged in rank order; blockwise recomputing backward.
- `gather`: all-gather each row chunk's full vocab (differentiable: backward slices), then plain
  float32 log_softmax / softmax autograd.
- `twopass_pairwise`: explicit pairwise tree sums in float32, max pass then log-softmax pass,
  entropy from the log-softmax; saves the masked log-softmax, not the softmax.
- `inplace_grad`: per-rank torch.logsumexp merged across ranks in log space; saves the softmax
  and turns that very buffer into the gradient in place in backward (slime #2144's memory trick).
- `autograd_collective`: plain autograd through a differentiable all-reduce SUM (identity
  backward) with a detached all-reduced max.

Two of them once drew false findings from the harness, which were the harness's to fix: the
`inplace_grad` gradient buffer counted by `memory-backward-frees` (it is the returned gradient),
and top-p cases built with an encoding slime does not use (docs/contract.md). Their worst margins
against the tolerance are in docs/tolerances.md.
"""
