"""The `openrlhf_loss` adapter's call of OpenRLHF's `PolicyLoss` for its reported KL, `ppo_kl`, on
synthetic trees that hold what `openrlhf/models/loss.py` holds (the class beside an import that is not
installed here, `masked_mean` from the tree's `utils.py`); a `PolicyLoss` that reports no `ppo_kl`
is refused. With OPENRLHF_TREE (an OpenRLHF tree's root) the same values are checked on OpenRLHF's own class.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from harness.targets.peers import openrlhf_loss as adapter  # noqa: F401 - what `reload_adapter` reloads
from harness.targets.peers._source import RoutineMissing

UTILS = '''
import deepspeed_is_not_installed_here


def masked_mean(tensor, mask, dim=None):
    if mask is None:
        return tensor.mean(dim=dim)
    return (tensor * mask).sum(dim=dim) / mask.sum(dim=dim)
'''
LOSS = '''
import torch.nn as nn

from .utils import masked_mean


class PolicyLoss(nn.Module):
    def __init__(self, clip_eps_low=0.2, clip_eps_high=0.2):
        super().__init__()
        self.clip_eps_low, self.clip_eps_high = clip_eps_low, clip_eps_high

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None):
        log_ratio = log_probs - old_log_probs
        ratio = log_ratio.exp()
        loss = masked_mean(-ratio * advantages, action_mask, dim=None)
        clip_ratio = masked_mean((ratio > 1 + self.clip_eps_high).float(), action_mask, dim=None)
        {KL}
'''
REPORTS = LOSS.replace("{KL}", "ppo_kl = masked_mean(-log_ratio.detach(), action_mask, dim=None)\n"
                                "        return loss, clip_ratio, ppo_kl")
SILENT = LOSS.replace("{KL}", "return loss, clip_ratio")


def _tree(root: Path, loss: str) -> Path:
    models = root / "openrlhf" / "models"
    models.mkdir(parents=True)
    (models / "utils.py").write_text(UTILS)
    (models / "loss.py").write_text(loss)
    return root


def _check(module) -> None:
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(9, generator=g, dtype=torch.float64).float() * 3
    cur = -torch.rand(9, generator=g, dtype=torch.float64).float() * 3
    mask = torch.rand(9, generator=g) < 0.7
    mask[0] = True
    out = module.kl_estimate(old, cur, kind="k1", mask=mask, reduction="token_mean")
    want = (old.double() - cur.double())[mask].mean()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    assert out.dim() == 0 and not out.requires_grad
    for kind, reduction in (("k3", "token_mean"), ("k1", "none")):
        with pytest.raises(NotImplementedError):
            module.kl_estimate(old, cur, kind=kind, reduction=reduction)


def test_ppo_kl_is_the_token_mean_of_old_minus_current(tmp_path, reload_adapter):
    _check(reload_adapter(_tree(tmp_path, REPORTS)))


def test_a_policy_loss_without_ppo_kl_is_refused(tmp_path, reload_adapter):
    with pytest.raises(RoutineMissing, match="ppo_kl"):
        reload_adapter(_tree(tmp_path, SILENT))


@pytest.mark.skipif(not os.environ.get("OPENRLHF_TREE"), reason="OPENRLHF_TREE (an OpenRLHF tree) not set")
def test_ppo_kl_on_openrlhfs_policy_loss(reload_adapter):
    _check(reload_adapter(Path(os.environ["OPENRLHF_TREE"])))
