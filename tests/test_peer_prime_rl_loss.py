"""The `prime_rl_loss` adapter's composition of prime-rl's train step on the logits, on synthetic
trees that hold what prime-rl's `src/prime_rl/trainer/rl/loss.py` holds in its two forms (labels
shifted, from prime-rl #1525 on; logits shifted, before it): the functions found by name, the
run-time shape checker's packages (jaxtyping, beartype) and prime-rl's config package absent, and
the response rows each sample's loss takes. With PRIME_RL_TREE (a prime-rl source tree's root) the
same rows are checked on prime-rl's own functions, run eagerly.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from harness.targets.peers import prime_rl_loss as adapter
from harness.targets.peers._source import RoutineMissing

HEAD = '''
import torch
from beartype import beartype as typechecker
from jaxtyping import Float, Int, jaxtyped
from torch import Tensor

from prime_rl.configs.trainer import LossConfig  # the trainer's config package: not in these trees


@jaxtyped(typechecker=typechecker)
def selective_log_softmax(logits: Float[Tensor, "b s v"], index: Int[Tensor, "b s"]) -> Float[Tensor, "b s"]:
    return logits.log_softmax(-1).gather(-1, index[..., None])[..., 0]


@jaxtyped(typechecker=typechecker)
def compute_entropy(logits: Float[Tensor, "b s v"]) -> Float[Tensor, "b s"]:
    with torch.no_grad():
        logp = logits.log_softmax(-1)
        return -(logp.exp() * logp).sum(-1)
'''
LABELS_FORM = HEAD + '''

def shift_tensor_left(t):
    return torch.cat([t[:, 1:], t.new_zeros(t.shape[0], 1)], dim=1)


def shift_tensor_right(t, pad_value=None):
    return torch.cat([t.new_full((t.shape[0], 1), 0.0 if pad_value is None else pad_value), t[:, :-1]], dim=1)
'''
LOGITS_FORM = HEAD + '''

def shift_logits(logits):
    return torch.cat([torch.zeros_like(logits[:, :1]), logits[:, :-1]], dim=1)
'''
LENGTHS, RESPONSES = [5, 3, 4], [2, 0, 3]


def _tree(root: Path, text: str) -> Path:
    path = root / "src" / "prime_rl" / "trainer" / "rl" / "loss.py"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return root


def _rows(temperature: float):
    """The adapter's response rows of log-probs and entropy, and the logits and ids they came from."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, sum(LENGTHS), 6, generator=g, dtype=torch.float32).requires_grad_()
    input_ids = torch.randint(0, 6, (1, sum(LENGTHS)), generator=g)
    log_probs, entropy = adapter.train_step(logits, input_ids, temperature)
    lp, ent = adapter.sample_rows(log_probs, LENGTHS, RESPONSES), adapter.sample_rows(entropy, LENGTHS, RESPONSES)
    return lp, ent, logits, input_ids


def _expected(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float):
    """Row o + j of sample i (offset o) predicts its token j + 1; the response is its last R tokens."""
    logp, ids = (logits[0].detach().double() / temperature).log_softmax(-1), input_ids[0]
    lps, ents, o = [], [], 0
    for n, r in zip(LENGTHS, RESPONSES, strict=True):
        rows = torch.arange(o + n - r - 1, o + n - 1)
        lps.append(logp[rows, ids[rows + 1]])
        ents.append(-(logp[rows].exp() * logp[rows]).sum(-1))
        o += n
    return lps, ents


def _check(temperature: float) -> None:
    lp, ent, logits, input_ids = _rows(temperature)
    want_lp, want_ent = _expected(logits, input_ids, temperature)
    assert [t.shape[0] for t in lp] == RESPONSES
    for a, b in zip(lp, want_lp, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
    for a, b in zip(ent, want_ent, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
    # prime-rl's entropy is a metric: no autograd history; the log-probs carry the gradient.
    assert all(t.requires_grad for t in lp if t.numel()) and not any(t.requires_grad for t in ent)


@pytest.mark.parametrize("text", [LABELS_FORM, LOGITS_FORM], ids=["labels-shifted", "logits-shifted"])
def test_response_rows_in_both_forms(tmp_path, monkeypatch, text):
    monkeypatch.syspath_prepend(str(_tree(tmp_path, text)))
    assert adapter._labels_form() is (text is LABELS_FORM)
    _check(temperature=0.7)


def test_a_tree_without_the_functions_is_refused(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(_tree(tmp_path, "import torch\n\n\ndef compute_loss():\n    pass\n")))
    with pytest.raises(RoutineMissing, match="selective_log_softmax"):
        adapter._find("selective_log_softmax")


@pytest.mark.skipif(not os.environ.get("PRIME_RL_TREE"), reason="PRIME_RL_TREE (a prime-rl source tree) not set")
def test_response_rows_on_prime_rls_functions(monkeypatch):
    monkeypatch.syspath_prepend(os.environ["PRIME_RL_TREE"])
    monkeypatch.setattr(torch._dynamo.config, "disable", True)  # eager, as history replays run
    _check(temperature=1.3)
