"""The field's peers loaded from their own source files (`harness.targets.peers._source`): SkyRL,
ms-swift and prime-rl. Each adapter loads and declares itself on any machine; with the peer's tree
on PYTHONPATH (the how-to is in each skip message) its routine is checked on inputs where it is
right, and where the harness finds a defect in it, on a case that shows it (docs/field-history.md).

Runs on the session's pools (the plugin's `harness_pools` fixture).
"""
from __future__ import annotations

import importlib
import sys

import pytest

from harness.cases.case import KernelCase, LinearCase, parse_case
from harness.driver.runner import Runner
from harness.targets import load_target
from harness.targets.peers import peers
from harness.targets.peers._source import PeerSource, RoutineMissing

NEW = ("skyrl", "skyrl_fused_linear", "ms_swift", "prime_rl")
PEERS = {p.name: p for p in peers()}


def _loaded(name: str):
    """The adapter's module when its peer's tree is on PYTHONPATH; else the test skips, saying how."""
    module = importlib.import_module(f"harness.targets.peers.{name}")
    if module.SOURCE.roots() == []:
        pytest.skip(f"{module.SOURCE.peer}'s source tree is not on PYTHONPATH: {module.SOURCE.how}")
    return module


def _findings(pools, name: str, spec: str) -> dict[str, str]:
    runner = Runner(PEERS[name].spec, pools=pools)
    _, found = runner.check(parse_case(spec))
    return {f.check: f.message for f in found}


def test_the_new_adapters_load_anywhere_and_say_how_to_get_their_peer() -> None:
    for name in NEW:
        peer = PEERS[name]
        assert load_target(peer.spec).levels and peer.upstream and "PYTHONPATH" in peer.install
    assert load_target(PEERS["prime_rl"].spec).levels == ("linear",)
    assert load_target(PEERS["skyrl_fused_linear"].spec).levels == ("linear",)


def test_a_tree_without_the_routine_is_refused_with_its_reason(tmp_path, monkeypatch) -> None:
    """The peer's tree is there, the routine's file is not (a commit before it existed): the
    adapter's import fails with the reason, which `harness history` shows as `untestable`."""
    (tmp_path / "skyrl" / "backends").mkdir(parents=True)
    source = PeerSource("SkyRL", files=("skyrl/backends/model_utils.py",), markers=("skyrl/backends",))
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    with pytest.raises(RoutineMissing, match="has none of skyrl/backends/model_utils.py"):
        source.load()
    monkeypatch.setattr(sys, "path", [])
    assert source.load() is None  # no tree: the adapter still imports; its calls say how to get the peer
    with pytest.raises(ImportError, match="not on PYTHONPATH"):
        source.require(None)


def test_stubs_stand_in_only_while_the_file_runs(tmp_path, monkeypatch) -> None:
    (tmp_path / "pkg" / "inner").mkdir(parents=True)
    (tmp_path / "pkg" / "inner" / "mod.py").write_text(
        "from pkg_heavy.logger import get_logger\nVALUE = get_logger()\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    source = PeerSource("pkg", files=("pkg/inner/mod.py",), markers=("pkg/inner",),
                        stubs={"pkg_heavy.logger": {"get_logger": lambda: 7}})
    assert source.load().VALUE == 7 and "pkg_heavy.logger" not in sys.modules


# Ordinary float32 inputs where each peer is right: chunked and not, TP 1 and 2, the hidden states
# strided at the fused-linear level.
CLEAN = {
    "skyrl": ["kernel:tp=1,T=6,v_local=5,seed=2", "kernel:tp=2,T=5,v_local=4,chunk_size=2,seed=1",
              "kernel:tp=2,T=7,v_local=3,chunk_size=3,with_entropy=0,seed=4"],
    "skyrl_fused_linear": ["linear:tp=1,T=6,H=8,v_local=5,with_entropy=0,seed=3,hidden_view=seq_first",
                           "linear:tp=2,T=7,H=8,v_local=5,chunk_size=3,with_entropy=0,seed=5,hidden_view=shifted"],
    "ms_swift": ["kernel:tp=1,T=6,v_local=5,seed=2", "kernel:tp=1,T=5,v_local=4,chunk_size=2,seed=1"],
    "prime_rl": ["linear:tp=1,T=6,H=8,v_local=5,with_entropy_grad=0,seed=3,hidden_view=seq_first",
                 "linear:tp=2,T=7,H=8,v_local=5,chunk_size=3,with_entropy_grad=0,seed=5,hidden_view=shifted"],
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(CLEAN))
def test_each_new_peer_is_right_on_ordinary_inputs(harness_pools, name: str) -> None:
    _loaded(name)
    for spec in CLEAN[name]:
        assert _findings(harness_pools, name, spec) == {}, spec


@pytest.mark.distributed
def test_ms_swift_loses_the_other_shards_gradient_at_tp_2(harness_pools) -> None:
    """ms-swift's vocab-parallel log-softmax all-reduces with `torch.distributed.all_reduce`, which
    autograd does not see: a rank that does not own a row's target gets no gradient for it."""
    _loaded("ms_swift")
    spec = KernelCase(tp=2, T=5, v_local=4, with_entropy=False, seed=1).spec()
    found = _findings(harness_pools, "ms_swift", spec)
    assert "gradients" in found and "values" not in found, found


@pytest.mark.distributed
def test_prime_rl_entropy_is_a_metric_its_backward_refuses(harness_pools) -> None:
    """prime-rl's fused LM head asserts in its backward that no gradient reaches the entropy."""
    _loaded("prime_rl")
    spec = LinearCase(tp=1, T=4, H=8, v_local=5, loss_terms="entropy", seed=6).spec()
    assert "crash" in _findings(harness_pools, "prime_rl", spec)


@pytest.mark.distributed
def test_skyrl_chunked_backward_raises_on_transposed_logits(harness_pools) -> None:
    """SkyRL #1650's scatter-add backward `view`s a gradient that keeps the logits' strides: a
    transposed [T, V_local] view of the logits makes it raise (SkyRL's main; its own worker hands
    contiguous logits)."""
    _loaded("skyrl")
    found = _findings(harness_pools, "skyrl", "kernel:tp=2,T=6,v_local=5,chunk_size=4,seed=14,layout=transposed")
    assert "view size is not compatible" in found.get("crash", ""), found
