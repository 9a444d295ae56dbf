"""The `megatron_rl` adapter's call of Megatron-LM's `calculate_grpo_loss`, on synthetic trees that hold
what `megatron/rl/rl_utils.py` holds (the function beside imports that are not installed here, and
`log_single_rank` from the tree's own `megatron/core/utils.py`), in both of its layouts; a tree without
the function is refused. With MEGATRON_LM_TREE (a Megatron-LM tree's root, `megatron/rl` and
`megatron/core` at least) the same values are checked on Megatron-LM's own function.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from harness.targets.peers import megatron_rl as adapter  # noqa: F401 - what `reload_adapter` reloads
from harness.targets.peers._source import RoutineMissing

RL_UTILS = '''
import logging

import torch
import wandb_is_not_installed_here

from megatron.core.utils import log_single_rank

logger = logging.getLogger(__name__)


def calculate_grpo_loss(current_logprobs, old_logprobs, ref_logprobs, advantages, clamp_eps_lower,
                        clamp_eps_upper, kl_beta, entropy_weight, inference_logprobs=None,
                        is_truncation_coef=None, seq_starts=None, seq_lengths=None):
    if current_logprobs.shape != old_logprobs.shape:
        log_single_rank(logger, logging.WARNING, "shape mismatch")
    ratios = (current_logprobs - old_logprobs).exp()
    diff = ref_logprobs - current_logprobs
    kl = diff.exp() - diff - 1
    loss = -ratios * advantages.view(-1, 1) + kl_beta * kl
    return loss, kl, ratios, current_logprobs
'''
CORE_UTILS = '''
def log_single_rank(logger, level, message):
    logger.log(level, message)
'''


def _tree(root: Path, rel: str, text: str) -> Path:
    for path, body in ((root / rel, text), (root / "megatron" / "core" / "utils.py", CORE_UTILS)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    return root


def _check(module) -> None:
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(9, generator=g, dtype=torch.float64) * 3).float().requires_grad_()
    ref = -torch.rand(9, generator=g, dtype=torch.float64).float() * 3
    out = module.kl_estimate(lp, ref, kind="k3")
    x = lp.detach().double() - ref.double()
    torch.testing.assert_close(out.double(), (-x).exp() - 1 + x, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    torch.testing.assert_close(lp.grad.double(), 1 - (-x).exp(), rtol=1e-5, atol=1e-6)
    for kind, reduction in (("k1", "none"), ("k3", "token_mean")):
        with pytest.raises(NotImplementedError):
            module.kl_estimate(lp, ref, kind=kind, reduction=reduction)


@pytest.mark.parametrize("rel", ["megatron/rl/rl_utils.py", "megatron/training/rl_utils.py"])
def test_kl_term_per_token_in_both_layouts(tmp_path, reload_adapter, rel):
    _check(reload_adapter(_tree(tmp_path, rel, RL_UTILS)))


def test_a_tree_without_the_function_is_refused(tmp_path, reload_adapter):
    with pytest.raises(RoutineMissing, match="calculate_grpo_loss"):
        reload_adapter(_tree(tmp_path, "megatron/rl/rl_utils.py", "import torch\n"))


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_TREE"), reason="MEGATRON_LM_TREE (a Megatron-LM tree) not set")
def test_kl_term_on_megatron_lms_function(reload_adapter):
    _check(reload_adapter(Path(os.environ["MEGATRON_LM_TREE"])))
