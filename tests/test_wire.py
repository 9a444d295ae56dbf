"""A rank's reply reaches the driver bit for bit: `engine.wire` carries CPU tensors as their raw bytes
and leaves every other object to pickle (and to torch's own reducer)."""
from __future__ import annotations

import pickle

import pytest
import torch

from harness.engine import wire
from harness.engine.observations import Observation, RankResult, TensorMeta


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert type(b) is type(a)
    assert (b.dtype, b.shape, b.stride(), b.storage_offset(), b.requires_grad) == \
           (a.dtype, a.shape, a.stride(), a.storage_offset(), a.requires_grad)
    sa, sb = a.untyped_storage(), b.untyped_storage()
    assert sb.nbytes() == sa.nbytes()
    assert torch.equal(torch.tensor([], dtype=torch.uint8).set_(sa), torch.tensor([], dtype=torch.uint8).set_(sb))


def _nan_with_payload() -> torch.Tensor:
    # two NaNs with payloads and a subnormal: a round trip through float values could lose them
    return torch.tensor([0x7FC00001, 0xFFC12345 - (1 << 32), 0x00000001], dtype=torch.int32).view(torch.float32)


TENSORS = {
    "float32": torch.randn(3, 5),
    "bfloat16": torch.randn(4, 3).to(torch.bfloat16),
    "float64": torch.randn(7, dtype=torch.float64),
    "nan payloads": _nan_with_payload(),
    "int64": torch.arange(-3, 9),
    "bool": torch.tensor([True, False, True]),
    "transposed": torch.randn(4, 6).t(),
    "view with offset": torch.randn(10)[3:8:2],
    "empty": torch.empty(0, 7),
    "scalar": torch.tensor(2.5),
    "leaf requiring grad": torch.randn(3, requires_grad=True),
}


@pytest.mark.parametrize("name", TENSORS)
def test_a_cpu_tensor_comes_back_bit_for_bit_with_its_geometry(name):
    t = TENSORS[name]
    _same(t, wire.loads(wire.dumps(t)))


def test_a_tensor_is_sent_as_its_bytes_not_through_torch_save():
    t = torch.randn(64, 32)
    assert b"torch._utils" not in wire.dumps(t)  # torch's own reducer names its rebuild functions
    assert b"torch._utils" in pickle.dumps(t, protocol=pickle.HIGHEST_PROTOCOL)


def test_tensors_it_cannot_describe_keep_torchs_reducer():
    param = torch.nn.Parameter(torch.randn(3))
    sparse = torch.randn(3, 3).to_sparse()
    tagged = torch.randn(2)
    tagged.note = "kept"  # Python attributes travel only through torch's reducer
    for t in (param, sparse, tagged):
        assert b"torch._utils" in wire.dumps(t)
    back = wire.loads(wire.dumps(tagged))
    assert back.note == "kept" and torch.equal(back, tagged)
    assert isinstance(wire.loads(wire.dumps(param)), torch.nn.Parameter)
    assert torch.equal(wire.loads(wire.dumps(sparse)).to_dense(), sparse.to_dense())


def test_a_rank_result_round_trips_whole():
    result = RankResult(1, trace=[], replica=1, cp_rank=0, groups=(1, 2))
    result.obs = Observation(stage="backward", log_prob=torch.randn(5), entropy=[torch.randn(2), torch.randn(0)],
                             log_prob_meta=TensorMeta((5,), "float32", False), grad=torch.randn(5, 3),
                             memory={"retained": 120, "peak_forward_tensors": [{"shape": [5, 3]}]})
    back = wire.loads(wire.dumps(result))
    assert (back.rank, back.replica, back.groups, back.obs.stage, back.obs.memory, back.obs.log_prob_meta) == \
           (1, 1, (1, 2), "backward", result.obs.memory, result.obs.log_prob_meta)
    _same(result.obs.grad, back.obs.grad)
    for a, b in zip(result.obs.entropy, back.obs.entropy, strict=True):
        _same(a, b)
