"""verl's KL loss (`kl_penalty` and `agg_loss`, `verl/trainer/ppo/core_algos.py`), at the KL-estimator level.

verl's PPO loss adds its KL term as `kl_penalty(logprob=log_prob, ref_logprob=ref_log_prob,
kl_penalty=config.kl_loss_type)` reduced by `agg_loss(loss_mat=kld, loss_mask=response_mask,
loss_agg_mode=config.loss_agg_mode, ...)` (`verl/workers/utils/losses.py:132-139`). The adapter
calls the two the same way on a micro-batch of one row (`[1, T]`): `reduction="none"` is
`kl_penalty`'s per-token output, `"token_mean"` and `"sum"` are `agg_loss`'s `"token-mean"` and
`"token-sum"` (a commit before verl #7197 has no `"token-sum"`: no masked sum, `kl_sum`). verl
always passes its response mask: a case without one is given every token.

What verl has no argument for, the adapter declares absent (`cases/kl.py::fit_kl`): no clamp
argument (`kl_clamp`: its `k3` clamps the log-ratio to [-20, 20] whatever it is asked,
`core_algos.py:2241`, and k1 and k2 never), no mask on the per-token estimates
(`kl_masked_tokens`: the mask enters `agg_loss`). Its `k3` also clamps the estimate to [-10, 10]
(`:2244`), and its arithmetic is the log-probs' own dtype: its known file says so.

The functions are compiled alone from `core_algos.py` (`PeerSource.find`), from the verl installed
or the tree on `PYTHONPATH`.
"""
from __future__ import annotations

from typing import Any

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._source import PeerSource

HOW = "pip install verl==0.9.1, or a verl tree on PYTHONPATH (its KL functions need torch only)"
SOURCE = PeerSource("verl-kl", files=("verl/trainer/ppo/core_algos.py",), markers=("verl/trainer",), how=HOW)


def _takes_token_sum() -> bool:
    """Whether this commit's `agg_loss` has the `"token-sum"` mode (verl #7197 on): its masked sum."""
    roots = SOURCE.roots()
    file = roots[0] / SOURCE.files[0] if roots else None
    return file is None or not file.is_file() or '"token-sum"' in file.read_text(encoding="utf-8", errors="replace")


def verl_kl(ca, log_probs, ref_log_probs, kind="k3", mask=None, reduction="none"):
    """verl's KL loss as the adapter calls it (`verl/workers/utils/losses.py:132-139`): `kl_penalty` per token,
    then `agg_loss` over the response mask (every token where none is given) of a one-row micro-batch, `ca`
    being `verl.trainer.ppo.core_algos` (imported: its file imports verl's utils). `harness repro --script`
    embeds it."""
    kld = ca.kl_penalty(logprob=log_probs, ref_logprob=ref_log_probs, kl_penalty=kind)
    if reduction == "none":
        return kld
    mask = torch.ones_like(kld, dtype=torch.bool) if mask is None else mask
    return ca.agg_loss(loss_mat=kld[None], loss_mask=mask[None], loss_agg_mode={"token_mean": "token-mean", "sum": "token-sum"}[reduction])


HARNESS = Declaration(
    capabilities={"kl_clamp": False, "kl_masked_tokens": False, **({} if _takes_token_sum() else {"kl_sum": False})},
    # `harness repro --script`: verl's module (imported, as its trainer does) and the call above.
    script={"name": "verl", "files": {"ca": "verl.trainer.ppo.core_algos"}, "kl": verl_kl,
            "how": "pip install verl==0.9.1 (TREE then empty), or a verl tree with verl's requirements installed (the "
                   "script imports verl.trainer.ppo.core_algos)"},
    peer=PeerInfo(requires=("verl",), install=HOW, upstream=(
        "verl.trainer.ppo.core_algos.kl_penalty", "verl.trainer.ppo.core_algos.agg_loss")),
)

_KL = SOURCE.find("kl_penalty")  # None without verl on sys.path
_AGG = SOURCE.find("agg_loss") if _KL is not None else None
_MODES = {"token_mean": "token-mean", "sum": "token-sum"}


def kl_estimate(log_probs: Any, ref_log_probs: Any, kind: str = "k3", mask: Any = None, reduction: str = "none",
                clamp: Any = None) -> Any:
    """The KL level's contract over verl's `kl_penalty` and its loss's `agg_loss`."""
    if clamp is not None:
        raise NotImplementedError("verl's kl_penalty takes no clamp (HARNESS_CAPABILITIES['kl_clamp'] is False)")
    if reduction == "none" and mask is not None:
        raise NotImplementedError("verl's per-token KL is unmasked (HARNESS_CAPABILITIES['kl_masked_tokens'] is False)")
    kld = SOURCE.require(_KL)(logprob=log_probs, ref_logprob=ref_log_probs, kl_penalty=kind)
    if reduction == "none":
        return kld
    response_mask = torch.ones_like(kld, dtype=torch.bool) if mask is None else mask
    return SOURCE.require(_AGG)(loss_mat=kld.unsqueeze(0), loss_mask=response_mask.unsqueeze(0),
                                loss_agg_mode=_MODES[reduction])
