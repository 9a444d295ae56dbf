"""The `skyrl_loss` adapter on SkyRL's own model wrapper, at TP 1 in this process: each sample's
response rows of log-probs and entropy against float64, the temperature divided by SkyRL (on its
re-padded copy, the caller's logits left as they are), and the entropy differentiable exactly when
the entropy loss is on. Skips without SkyRL's tree on sys.path."""
from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

skyrl_loss = pytest.importorskip("harness.targets.peers.skyrl_loss")
if skyrl_loss._TRAIN is None:
    pytest.skip("SkyRL's tree is not on sys.path", allow_module_level=True)

LENGTHS, RESPONSES = (5, 3, 4), (2, 0, 3)


@pytest.fixture(scope="module")
def tp1():
    from megatron.core import parallel_state

    started = not dist.is_initialized()
    if started:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1)
    yield
    parallel_state.destroy_model_parallel()
    if started:
        dist.destroy_process_group()


def _call(coef: float, temperature: float, chunk: int):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, sum(LENGTHS), 6, generator=g).requires_grad_()
    tokens = [torch.randint(0, 6, (n,), generator=g) for n in LENGTHS]
    args = SimpleNamespace(entropy_coef=coef, rollout_temperature=temperature, log_probs_chunk_size=chunk,
                           allgather_cp=False)
    before = logits.detach().clone()
    _, res = skyrl_loss.get_log_probs_and_entropy(logits, args=args, unconcat_tokens=tokens, total_lengths=LENGTHS,
                                                  response_lengths=RESPONSES, with_entropy=True)
    assert torch.equal(logits.detach(), before)  # SkyRL divides its own re-padded copy in place
    return res, logits, tokens


@pytest.mark.parametrize("coef,temperature,chunk", [(0.0, 1.0, -1), (0.01, 0.7, 2)])
def test_response_rows_match_float64(tp1, coef, temperature, chunk) -> None:
    res, logits, tokens = _call(coef, temperature, chunk)
    x = (logits.detach().double()[0] / temperature).log_softmax(-1)
    o = 0
    for i, (n, r) in enumerate(zip(LENGTHS, RESPONSES, strict=True)):
        rows = torch.arange(o + n - r - 1, o + n - 1)
        want_lp = x[rows, tokens[i][rows - o + 1]]
        want_ent = -(x[rows].exp() * x[rows]).sum(-1)
        assert res["log_probs"][i].shape == (r,) and res["entropy"][i].shape == (r,)
        torch.testing.assert_close(res["log_probs"][i].double(), want_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res["entropy"][i].double(), want_ent, rtol=1e-5, atol=1e-5)
        o += n
    assert all(t.requires_grad for t in res["log_probs"] if t.numel())
    assert all(t.requires_grad == (coef != 0.0) for t in res["entropy"] if t.numel())
