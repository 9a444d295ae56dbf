"""Megatron-LM's own RL loss (`calculate_grpo_loss`, `megatron/rl/rl_utils.py`), its KL term, at the KL-estimator level.

Megatron-LM's RL training step (`train_rl.py::forward_step`, :306-321 at d98e8a64d) calls
`calculate_grpo_loss(current_logprobs=..., old_logprobs=..., ref_logprobs=..., advantages=...,
clamp_eps_lower=args.grpo_clamp_eps_lower, clamp_eps_upper=args.grpo_clamp_eps_upper,
kl_beta=args.grpo_kl_beta, entropy_weight=args.grpo_entropy_term_weight, inference_logprobs=...,
is_truncation_coef=..., seq_starts=..., seq_lengths=...)` and hands its second output, `kl_term`, to
`loss_func`, which flattens it (`kl_term.reshape(-1)`, :130). The function computes it per token as
`ref_diff = ref_logprobs - current_logprobs; kl_term = ref_diff.exp() - ref_diff - 1`
(rl_utils.py:2843-2844): the k3 estimate of KL(pi || pi_ref) at `x = current - ref`, unmasked, with no
clamp, in the log-probs' own dtype; `kl_beta * kl_term` enters the per-token loss (:2856-2860), so it
carries the policy's gradient. The adapter calls the function as the caller does on an unpacked
micro-batch of one row (`[1, T]`, no sequence packing, no inference-logprob correction: `seq_starts`,
`seq_lengths`, `inference_logprobs` None), the contract's `log_probs` as `current_logprobs` and
`ref_log_probs` as `ref_logprobs`, the old log-probs equal to the current ones' values
(`log_probs.detach()`: the first update after a rollout, ratio 1), zero advantages (`[1]`) and the
arguments' defaults (`megatron/training/arguments.py:2740-2747`: eps 0.01 and 0.01, kl_beta 0.001,
entropy weight 0; `kl_term` depends on none of them), and returns `kl_term.reshape(-1)` for
`kind="k3"`, `reduction="none"`.

What it cannot be asked, the adapter declares or refuses:
- no clamp (`kl_clamp`), no mask on the per-token estimates (`kl_masked_tokens`), no masked sum
  (`kl_sum`), and one estimator, k3 (`k1` and `k2` declared absent: the function has no estimator
  argument, and the harness asks it the k3 only).
- no reduction (`kl_token_mean` absent: its cases run per token): the caller reduces in
  `train_rl.py::loss_func` (:113-136, 162: the float loss mask,
  `torch.sum(loss_mask_flat * kl_term_flat)` and the mask's token count floored at 1, a pair that
  `megatron/training/training.py:3237-3243` sums over micro-batches and data-parallel ranks and
  divides: a token mean, 0 over no valid token). `loss_func` moves its tensors to CUDA and reads
  Megatron's global arguments and rerun state machine, so the adapter does not call it.

The function's fourth output, `entropy_term = -current_logprobs.exp() * current_logprobs`
(:2845), is the sampled token's `-p log p`, not the entropy of the policy's distribution, and not a
KL-level quantity: the adapter leaves it alone.

The function is compiled alone from `rl_utils.py` (`PeerSource.find`: the file imports Megatron-LM's
whole RL stack, wandb, yaml and more); the names it reads at its top level (`log_single_rank` from
`megatron/core/utils.py`, `logger`, `logging`) are resolved from the same tree, so the tree must hold
`megatron/core` beside `megatron/rl` (Megatron-LM's `megatron/` has no `__init__.py`: a tree first on
`PYTHONPATH` gives `import megatron.core` its own megatron-core, as `harness history`'s export does).
Before Megatron-LM's "[2/4] Merge Megatron-RL into LM" (3a9cff6bc) the function lives in
`megatron/training/rl_utils.py`, where the adapter follows it.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._source import PeerSource

HOW = ("git clone https://github.com/NVIDIA/Megatron-LM && export PYTHONPATH=$PWD/Megatron-LM:$PYTHONPATH "
       "(the function needs torch and the tree's megatron/core/utils.py)")
SOURCE = PeerSource("Megatron-LM-rl", files=("megatron/rl/rl_utils.py", "megatron/training/rl_utils.py"),
                    markers=("megatron/rl", "megatron/training"), how=HOW)

HARNESS = Declaration(
    # The k3 only (no estimator argument: megatron/rl/rl_utils.py:2771-2784, 2843-2844), per token only
    # (its caller reduces it: train_rl.py's loss_func, which needs CUDA and Megatron's global arguments).
    capabilities={"kl_clamp": False, "kl_sum": False, "kl_masked_tokens": False, "k1": False, "k2": False,
                  "kl_token_mean": False},
    peer=PeerInfo(requires=("megatron.rl",), install=HOW, upstream=(
        "megatron.rl.rl_utils.calculate_grpo_loss (its kl_term output; megatron.training.rl_utils before 3a9cff6bc)",)),
)

_GRPO = SOURCE.find("calculate_grpo_loss")  # None without Megatron-LM's tree on sys.path


def megatron_grpo_kl(log_probs, ref_log_probs, kind="k3"):
    """`calculate_grpo_loss`'s `kl_term` (`megatron/rl/rl_utils.py`), called as the adapter calls it: the
    function compiled alone from the file on PYTHONPATH (whose imports are Megatron-LM's RL stack, which
    it never calls; its shape warning printed): `harness repro --script` embeds it."""
    import ast
    rel = "megatron/rl/rl_utils.py"  # FileNotFoundError where the tree is not
    path = next((p for p in (os.path.join(e or ".", rel) for e in sys.path) if os.path.isfile(p)), rel)
    body = [n for n in ast.parse(open(path).read()).body if getattr(n, "name", "") == "calculate_grpo_loss"]
    ns: dict = {"torch": torch, "logging": None, "logger": None, "log_single_rank": lambda *a: print(*a[2:])}
    exec(compile(ast.Module(ast.parse("from __future__ import annotations").body + body, []), path, "exec"), ns)
    cur = log_probs[None]  # old = current, zero advantages, the defaults (eps 0.01, kl_beta 0.001, no entropy term)
    return ns["calculate_grpo_loss"](cur, cur.detach(), ref_log_probs[None], torch.zeros(1, dtype=cur.dtype), 0.01, 0.01, 0.001, 0.0)[1].reshape(-1)  # noqa: E501


# `harness repro --script`: the call above, which reads main's layout (megatron/rl/rl_utils.py).
HARNESS = dataclasses.replace(HARNESS, script={"name": "Megatron-LM", "kl": megatron_grpo_kl, "how": HOW})


def kl_estimate(log_probs: Any, ref_log_probs: Any, kind: str = "k3", mask: Any = None, reduction: str = "none",
                clamp: Any = None) -> Any:
    """The KL level's contract over Megatron-LM's `calculate_grpo_loss` `kl_term`, per token."""
    if clamp is not None:
        raise NotImplementedError("Megatron-LM's kl_term clamps no log-ratio (HARNESS_CAPABILITIES['kl_clamp'] is False)")
    if reduction == "none" and mask is not None:
        raise NotImplementedError("Megatron-LM's kl_term is unmasked (HARNESS_CAPABILITIES['kl_masked_tokens'] is False)")
    if reduction != "none":
        raise NotImplementedError("Megatron-LM reduces kl_term in train_rl.py's loss_func, which needs CUDA and its "
                                  "global arguments; the adapter returns the function's per-token kl_term only")
    if kind != "k3":
        raise NotImplementedError(f"Megatron-LM's kl_term is the k3 estimate only, not {kind} "
                                  "(megatron/rl/rl_utils.py:2843-2844)")
    current = log_probs.unsqueeze(0)
    out = SOURCE.require(_GRPO)(
        current_logprobs=current, old_logprobs=current.detach(), ref_logprobs=ref_log_probs.unsqueeze(0),
        advantages=torch.zeros(1, dtype=current.dtype, device=current.device),
        clamp_eps_lower=0.01, clamp_eps_upper=0.01, kl_beta=0.001, entropy_weight=0.0)
    return out[1].reshape(-1)  # (loss, kl_term, ratios, entropy_term, ...); loss_func's reshape, train_rl.py:130
