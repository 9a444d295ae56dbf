"""OpenRLHF's KL estimators (`compute_approx_kl`, `openrlhf/models/utils.py`) and its KL loss's aggregation (`aggregate_loss`, `openrlhf/models/loss.py`), at the KL-estimator level.

OpenRLHF's actor computes the KL term of its loss as `compute_approx_kl(action_log_probs,
base_action_log_probs, kl_estimator=...)` and reduces it with `aggregate_loss(kl, action_mask,
...)` (`openrlhf/trainer/ray/ppo_actor.py:320-330`): a token mean over the micro-batch's action
tokens with the default token-level loss (`masked_mean(loss, mask, dim=None)`). The adapter calls
the two the same way: `reduction="none"` is the estimator's per-token output, `"token_mean"` its
aggregation (`masked_mean` on commits before `aggregate_loss`).

What OpenRLHF has no argument for, the adapter declares absent (`cases/kl.py::fit_kl`): no clamp of
the log-ratio (`kl_clamp`), no masked sum (`kl_sum`), no mask on the per-token estimates
(`kl_masked_tokens`: its per-token KL is unmasked, the mask enters its mean). It clamps the estimate
itself to [-10, 10] whatever the kind (`utils.py:95`), which the contract leaves to a caller
(docs/kl.md): its known file says so.

The functions are compiled alone from their files (`PeerSource.find`): `utils.py` imports deepspeed
at its top, which the estimator never calls.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._source import PeerSource

HOW = ("git clone https://github.com/OpenRLHF/OpenRLHF && export PYTHONPATH=$PWD/OpenRLHF:$PYTHONPATH "
       "(its KL estimator and loss aggregation need torch only)")
SOURCE = PeerSource("OpenRLHF", files=("openrlhf/models/utils.py", "openrlhf/models/loss.py"),
                    markers=("openrlhf/models",), how=HOW)


def openrlhf_kl(log_probs, ref_log_probs, kind="k3", mask=None, reduction="none"):
    """OpenRLHF's KL term as the adapter calls it (`ppo_actor.py:320-330`): `compute_approx_kl` per token,
    then, for the token mean, `aggregate_loss` over the mask (`masked_mean` on commits before it), with no
    global batch info. `utils.py` imports deepspeed at its top, which neither calls: the functions are
    compiled alone from OpenRLHF's files on PYTHONPATH. `harness repro --script` embeds it."""
    import ast
    ns: dict = {"torch": torch}
    for rel in ("openrlhf/models/utils.py", "openrlhf/models/loss.py"):  # FileNotFoundError where the tree is not
        path = next((p for p in (os.path.join(e or ".", rel) for e in sys.path) if os.path.isfile(p)), rel)
        body = [n for n in ast.parse(open(path).read()).body if getattr(n, "name", "") in ("compute_approx_kl", "masked_mean", "aggregate_loss")]
        exec(compile(ast.Module(ast.parse("from __future__ import annotations").body + body, []), path, "exec"), ns)  # alone
    kl = ns["compute_approx_kl"](log_probs, ref_log_probs, kl_estimator=kind)
    return kl if reduction == "none" else ns.get("aggregate_loss", ns["masked_mean"])(kl, mask)


HARNESS = Declaration(
    capabilities={"kl_clamp": False, "kl_sum": False, "kl_masked_tokens": False},
    # `harness repro --script`: the call above (the tree's files are read by it, not loaded as modules).
    script={"name": "OpenRLHF", "kl": openrlhf_kl, "how": "git clone https://github.com/OpenRLHF/OpenRLHF "
            "&& export PYTHONPATH=$PWD/OpenRLHF:$PYTHONPATH (torch only: the script compiles its two functions alone)"},
    peer=PeerInfo(requires=("openrlhf",), install=HOW, upstream=(
        "openrlhf.models.utils.compute_approx_kl", "openrlhf.models.loss.aggregate_loss")),
)

_KL = SOURCE.find("compute_approx_kl")  # None without OpenRLHF's tree on sys.path
_MEAN = (SOURCE.find("aggregate_loss") if SOURCE.defines("aggregate_loss") else SOURCE.find("masked_mean")) \
    if _KL is not None else None


def kl_estimate(log_probs: Any, ref_log_probs: Any, kind: str = "k3", mask: Any = None, reduction: str = "none",
                clamp: Any = None) -> Any:
    """The KL level's contract over OpenRLHF's estimator and its loss's token mean."""
    if clamp is not None:
        raise NotImplementedError("OpenRLHF clamps no log-ratio (HARNESS_CAPABILITIES['kl_clamp'] is False)")
    if reduction == "sum":
        raise NotImplementedError("OpenRLHF's KL loss takes no masked sum (HARNESS_CAPABILITIES['kl_sum'] is False)")
    if reduction == "none" and mask is not None:
        raise NotImplementedError("OpenRLHF's per-token KL is unmasked (HARNESS_CAPABILITIES['kl_masked_tokens'] "
                                  "is False)")
    kl = SOURCE.require(_KL)(log_probs, ref_log_probs, kl_estimator=kind)
    if reduction == "none":
        return kl
    return SOURCE.require(_MEAN)(kl, mask)  # mask None: OpenRLHF's `masked_mean` is the plain mean
