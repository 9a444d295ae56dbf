"""The `verl_loss` adapter's own pieces: verl's processor found with the flags its engine binds, the
engine config built from a case, and the model-output stand-in (no copy, the gradient unchanged).
Skips without verl's tree (an installed verl or one on PYTHONPATH)."""
from __future__ import annotations

import inspect

import pytest
import torch

verl_loss = pytest.importorskip("harness.targets.peers.verl_loss")
if verl_loss._CLASS is None:
    pytest.skip("verl's tree is not on sys.path", allow_module_level=True)


def test_the_engine_flags_are_every_keyword_the_processor_takes() -> None:
    """A processor that grew a keyword `forward_step` binds would be called without it: a TypeError
    here, not a silent default in every case."""
    method = verl_loss._CLASS._lm_head_logits_processor
    params = inspect.signature(method).parameters
    flags = verl_loss._flags(method, calculate_entropy=True)
    keyword = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keyword == set(flags)
    assert flags["calculate_entropy"] is True and flags["distillation_only"] is False


def test_engine_config_chunks_the_entropy_exactly_when_a_chunk_size_is_given() -> None:
    chunked, plain = verl_loss.engine_config(3, 2), verl_loss.engine_config(-1, 1)
    assert chunked.entropy_from_logits_with_chunking and chunked.entropy_from_logits_chunk_size == 3
    assert not plain.entropy_from_logits_with_chunking
    assert verl_loss.engine(chunked).engine_config is chunked


def test_the_model_output_shares_the_callers_storage_and_passes_the_gradient() -> None:
    x = torch.randn(1, 3, 4, requires_grad=True)
    before = x.detach().clone()
    y = verl_loss._model_output(x)
    assert y is not x and y.data_ptr() == x.data_ptr() and y.requires_grad
    y.div_(2.0)  # what verl's processor does to its model output: refused on the leaf itself
    assert torch.equal(x.detach(), before / 2)  # the write lands on the caller's logits, as on verl's
    (y * torch.arange(12.0).reshape(1, 3, 4)).sum().backward()
    assert torch.equal(x.grad, torch.arange(12.0).reshape(1, 3, 4) / 2)
    with torch.no_grad():
        assert verl_loss._model_output(x) is x
