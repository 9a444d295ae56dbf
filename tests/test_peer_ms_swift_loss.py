"""The `ms_swift_loss` adapter's own pieces: the collated micro-batch in ms-swift's frame, the model
stand-in (the caller's storage, the gradient unchanged), and one call of ms-swift's `forward_step` at
TP 1 against float64 log-softmax. Skips without ms-swift's tree on sys.path."""
from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch

ms_swift_loss = pytest.importorskip("harness.targets.peers.ms_swift_loss")
if ms_swift_loss._GRPO is None:
    pytest.skip("ms-swift's tree is not on sys.path", allow_module_level=True)


def test_the_micro_batch_labels_the_responses_and_masks_their_rows() -> None:
    tokens = [torch.tensor([5, 6, 7, 8]), torch.tensor([1, 2])]
    data, mask, seq_lengths = ms_swift_loss._micro_batch(tokens, [4, 2], [2, 1], torch.device("cpu"))
    assert data["labels"].tolist() == [[-100, -100, 7, 8, -100, 2]]
    assert data["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1]]
    # The trainer's frame: the rolled labels that are not -100, right-aligned to the longest sample.
    rolled = torch.roll(data["labels"], -1, dims=-1)[0] != -100
    assert rolled.tolist() == [False, True, True, False, True, False]
    assert mask.tolist() == [[False, True, True, False], [False, False, True, False]]
    assert seq_lengths.tolist() == [4, 2]


def test_the_model_output_is_the_callers_storage_and_passes_the_gradient() -> None:
    x = torch.randn(1, 3, 4, requires_grad=True)
    before = x.detach().clone()
    y = ms_swift_loss._Model(x)()
    assert y is not x and y.data_ptr() == x.data_ptr() and not y.is_leaf
    y.div_(2.0)  # forward_step's `logits_packed.div_(self.temperature)`: refused on the leaf itself
    assert torch.equal(x.detach(), before / 2)
    (y * torch.arange(12.0).reshape(1, 3, 4)).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.arange(12.0).reshape(1, 3, 4) / 2)
    with torch.no_grad():
        assert ms_swift_loss._Model(x)() is x


@pytest.fixture
def tp1():
    from megatron.core import parallel_state

    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1)
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def test_forward_step_at_tp1_gives_the_responses_log_probs_and_entropy(tp1) -> None:
    g = torch.Generator().manual_seed(0)
    lengths, responses, temperature = [5, 3], [3, 1], 0.7
    base = torch.randn(sum(lengths), 6, generator=g, dtype=torch.float64)
    tokens = [torch.randint(0, 6, (n,), generator=g) for n in lengths]
    logits = base.float().unsqueeze(0).requires_grad_()
    args = SimpleNamespace(log_probs_chunk_size=-1, allgather_cp=False, rollout_temperature=temperature)
    _, res = ms_swift_loss.get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=tokens, total_lengths=lengths, response_lengths=responses,
        with_entropy=True)
    logp = torch.log_softmax(base / temperature, -1)
    offset = 0
    for i, (n, r) in enumerate(zip(lengths, responses, strict=True)):
        rows = torch.arange(offset + n - r - 1, offset + n - 1)
        want = logp[rows, tokens[i][n - r:]]
        entropy = -(logp[rows].exp() * logp[rows]).sum(-1)
        torch.testing.assert_close(res["log_probs"][i].double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res["entropy"][i].double(), entropy, rtol=1e-5, atol=1e-5)
        offset += n
    torch.stack([t.sum() for t in res["log_probs"]]).sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
