"""OpenRLHF's policy loss's reported KL (`ppo_kl` of `PolicyLoss.forward`, `openrlhf/models/loss.py`), at the KL-estimator level.

OpenRLHF's actor calls its policy loss as `self.actor_loss_fn(action_log_probs, old_action_log_probs,
advantages, action_mask=experience.action_mask, rollout_log_probs=experience.rollout_log_probs,
**loss_batch_info)` and logs its third output, `experience.info["ppo_kl"] = ppo_kl.detach()`
(`openrlhf/trainer/ray/ppo_actor.py:306-315`). `PolicyLoss.forward` computes it as
`masked_mean(-(log_probs - old_log_probs).detach(), action_mask, dim=None)` (`loss.py:166, 229`): the
mean over the micro-batch's action tokens of `old - current`, the k1 estimate of KL(pi_old || pi)
from tokens sampled by the old policy. In the contract's terms (KL(pi || pi_ref), `x = log_probs -
ref_log_probs`, samples from pi) the contract's `log_probs` are OpenRLHF's `old_log_probs` and its
`ref_log_probs` are the current policy's: the adapter passes them so, with zero advantages and the
constructor's defaults (`policy_loss_type="ppo"`, no vLLM importance-sampling correction), on a
micro-batch of one row (`[1, T]`), and returns `ppo_kl` for `kind="k1"` with a token mean.

What it cannot be asked, the adapter declares or refuses:
- no clamp argument (`kl_clamp`), no masked sum (`kl_sum`), no per-token output at all
  (`kl_per_token`, `kl_masked_tokens`: `forward` returns the mean only), one estimator, k1 (`k2`,
  `k3` absent), and no gradient (`kl_differentiable` absent, below): its cases are fitted to a
  detached k1 token mean.
- the actor always passes its action mask (a bool `[B, A]`, `openrlhf/trainer/ppo_utils/experience.py:43`):
  a case without one is given every token.

`ppo_kl` is a metric: detached in `forward` and again by the actor, it never reaches the loss; in OpenRLHF the old
log-probs come from the actor under `torch.no_grad()` (`ppo_actor.py:634-641`), so that input never
requires grad there. The class is compiled alone from `loss.py` (`PeerSource.find`, its base
`nn.Module` from torch); a commit whose `PolicyLoss` reports no `ppo_kl` (before OpenRLHF's "support
ppo_kl", 2025-07-27) is refused at import (`RoutineMissing`), which `harness history` reports as
untestable.
"""
from __future__ import annotations

import ast
import dataclasses
from typing import Any

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._source import PeerSource, RoutineMissing

HOW = ("git clone https://github.com/OpenRLHF/OpenRLHF && export PYTHONPATH=$PWD/OpenRLHF:$PYTHONPATH "
       "(its policy loss needs torch only)")
SOURCE = PeerSource("OpenRLHF-loss", files=("openrlhf/models/loss.py",), markers=("openrlhf/models",), how=HOW)

HARNESS = Declaration(
    # One estimate (the k1, openrlhf/models/loss.py:229), a token mean only (:229-230), detached (a logged
    # metric: loss.py:229, ppo_actor.py:315; its policy input, the old log-probs, comes from the actor
    # under torch.no_grad(), ppo_actor.py:634-641).
    capabilities={"kl_clamp": False, "kl_sum": False, "kl_masked_tokens": False, "k2": False, "k3": False,
                  "kl_per_token": False, "kl_differentiable": False},
    peer=PeerInfo(requires=("openrlhf",), install=HOW, upstream=(
        "openrlhf.models.loss.PolicyLoss.forward (its ppo_kl output)",)),
    # What OpenRLHF's actor makes of `ppo_kl` (openrlhf/trainer/ray/ppo_actor.py at 3c3be6234); the
    # harness's cases beyond it are findings beyond its use (harness.checks.use).
    use=[
        {"where": {"dtype": "bf16"},
         "why": "openrlhf/models/actor.py:267: the actor casts its logits to float32, so the current and the "
                "old log-probs reach the policy loss in float32"},
    ],
)


def _reports_ppo_kl() -> bool:
    """Whether this commit's `PolicyLoss.forward` binds a `ppo_kl` (OpenRLHF's "support ppo_kl" on)."""
    roots = SOURCE.roots()
    file = roots[0] / SOURCE.files[0] if roots else None
    if file is None or not file.is_file():
        return False
    for node in ast.parse(file.read_text(encoding="utf-8", errors="replace")).body:
        if isinstance(node, ast.ClassDef) and node.name == "PolicyLoss":
            return any(isinstance(n, ast.Name) and n.id == "ppo_kl" and isinstance(n.ctx, ast.Store)
                       for n in ast.walk(node))
    return False


_POLICY_LOSS = SOURCE.find("PolicyLoss")  # None without OpenRLHF's tree on sys.path
if _POLICY_LOSS is not None and not _reports_ppo_kl():
    raise RoutineMissing("OpenRLHF's PolicyLoss at this commit reports no ppo_kl (before OpenRLHF's "
                         "\"support ppo_kl\", 30a02e9c)")


def kl_estimate(log_probs: Any, ref_log_probs: Any, kind: str = "k3", mask: Any = None, reduction: str = "none",
                clamp: Any = None) -> Any:
    """The KL level's contract over OpenRLHF's `PolicyLoss` reported KL, `ppo_kl`: `log_probs` as
    its `old_log_probs`, `ref_log_probs` as the current policy's `log_probs`."""
    if clamp is not None:
        raise NotImplementedError("OpenRLHF's ppo_kl clamps no log-ratio (HARNESS_CAPABILITIES['kl_clamp'] is False)")
    if reduction == "sum":
        raise NotImplementedError("OpenRLHF's ppo_kl is a token mean, no sum (HARNESS_CAPABILITIES['kl_sum'] is False)")
    if reduction == "none":
        raise NotImplementedError("OpenRLHF's PolicyLoss returns no per-token KL: ppo_kl is a token mean "
                                  "(openrlhf/models/loss.py:229-230)")
    if kind != "k1":
        raise NotImplementedError(f"OpenRLHF's ppo_kl is the k1 estimate only, not {kind} "
                                  "(openrlhf/models/loss.py:229)")
    loss_fn = SOURCE.require(_POLICY_LOSS)()  # the actor's construction, defaults (ppo_actor.py:76-88)
    current = ref_log_probs.unsqueeze(0)
    old = log_probs.unsqueeze(0)
    action_mask = torch.ones_like(old, dtype=torch.bool) if mask is None else mask.unsqueeze(0)
    advantages = torch.zeros_like(current)
    out = loss_fn(current, old, advantages, action_mask=action_mask)
    return out[2]  # (loss, clip_ratio, ppo_kl[, vllm_kl])


def openrlhf_ppo_kl(utils, loss, log_probs, ref_log_probs, mask=None):
    """`PolicyLoss()`'s reported `ppo_kl` (`loss`, its `masked_mean` from `utils`) as the actor calls it:
    the contract's `log_probs` as the old log-probs, `ref_log_probs` as the current ones, zero
    advantages, every token valid without a mask: `harness repro --script` embeds it."""
    old, current = log_probs[None], ref_log_probs[None]
    action_mask = torch.ones_like(old, dtype=torch.bool) if mask is None else mask[None]
    return loss.PolicyLoss()(current, old, torch.zeros_like(current), action_mask=action_mask)[2]


# `harness repro --script` (the layout with `ppo_kl`); `utils.py` imports deepspeed at its top, which no call reaches.
HARNESS = dataclasses.replace(HARNESS, script={
    "name": "OpenRLHF", "kl": openrlhf_ppo_kl, "how": HOW, "stubs": {"deepspeed": ()},
    "files": {"utils": "openrlhf/models/utils.py", "loss": "openrlhf/models/loss.py"}})
