"""Adapters that follow their routine through a trainer's history (`PeerSource.find`): a function, a
class or a trainer's method found by name across the files it has lived in, compiled alone with the
names it reads, so that a commit is checked or says precisely why it cannot be (the routine absent,
a dependency not installed, an adapter's stub that lacks a name); and replays that run eager.

The synthetic trees below hold what the trainers' files hold: a package `__init__` that imports the
whole training stack, a trainer class whose bases and other methods need it, and a loss method that
needs none of it. The tests over real commits need the trainers' git histories (a clone or a bare
mirror in MS_SWIFT_REPO, VERL_REPO, NEMO_RL_REPO) and skip without them.
"""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from harness.driver import replay
from harness.driver.git_trees import Commit
from harness.targets.peers._source import PeerSource, RoutineMissing

TRAINER = '''
import training_stack_not_installed
from megatron_training_not_installed import get_args
from acme.helpers import scale, Kind


class Trainer(training_stack_not_installed.Base):
    def __init__(self):
        raise RuntimeError("the trainer's __init__ builds models")

    def loss(self, x):
        return self._inner(x) * self.temperature

    def _inner(self, x):
        return scale(x)

    def with_args(self, x):
        return x * get_args().scale

    def unrelated(self):
        return training_stack_not_installed.go()


class Config(Kind):
    kind = Kind.mode  # a class body reads its module's names when it runs
'''
HELPERS = '''
import math


class Kind:
    mode = "forward"


def scale(x):
    return math.floor(x) + OFFSET


OFFSET = 1
'''


def _tree(root: Path) -> PeerSource:
    pkg = root / "acme"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('the package __init__ imports the whole training stack')\n")
    (pkg / "trainer.py").write_text(TRAINER)
    (pkg / "helpers.py").write_text(HELPERS)
    (pkg / "config.py").write_text("from acme.stubbed import Present, Absent\n")
    return PeerSource("acme", files=("acme/loss.py", "acme/trainer.py"), markers=("acme",))


def test_a_method_is_found_in_its_trainer_and_compiled_with_only_what_it_reaches(tmp_path, monkeypatch) -> None:
    source = _tree(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert source.defines("Trainer.loss") and not source.defines("Trainer.missing")
    cls = source.find("Trainer.loss")
    assert {"loss", "_inner"} <= set(vars(cls)) and "unrelated" not in vars(cls) and "__init__" not in vars(cls)
    trainer = cls.__new__(cls)
    trainer.temperature = 2.0
    assert trainer.loss(3.5) == 8.0  # (floor(3.5) + OFFSET) * temperature: helpers.py read file by file
    assert source.find("Config").kind == "forward"
    with pytest.raises(RoutineMissing, match="defines no Trainer.missing in any of acme/loss.py, acme/trainer.py"):
        source.find("Trainer.missing")
    monkeypatch.setattr(sys, "path", [])
    assert source.find("Trainer.loss") is None and source.defines("Trainer.loss") is None  # no tree here


def test_a_dependency_it_reads_is_named_when_missing_and_an_adapter_may_provide_it(tmp_path, monkeypatch) -> None:
    source = _tree(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    with pytest.raises(ModuleNotFoundError, match=r"acme's acme/trainer.py:3 imports megatron_training_not_installed: "
                                                  r"No module named 'megatron_training_not_installed'"):
        source.find("Trainer.with_args")  # said before any case runs, not as a crash inside one
    args = argparse.Namespace(scale=3)
    provided = PeerSource("acme", files=source.files, markers=source.markers, provides={"get_args": lambda: args})
    cls = provided.find("Trainer.with_args")
    assert cls.__new__(cls).with_args(2) == 6


def test_an_import_an_adapters_stub_lacks_names_the_stub(tmp_path, monkeypatch) -> None:
    _tree(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    stubs = {"acme.stubbed": {"Present": object}}
    loaded = PeerSource("acme-config", files=("acme/config.py",), markers=("acme",), stubs=stubs)
    with pytest.raises(ImportError, match="acme.stubbed is the adapter's stub \\(holding Present\\), which lacks"):
        loaded.load()
    (tmp_path / "acme" / "config.py").write_text("from acme.stubbed import Absent\n\n\ndef f():\n    return Absent\n")
    found = PeerSource("acme-config-found", files=("acme/config.py",), markers=("acme",), stubs=stubs)
    with pytest.raises(ImportError, match="acme.stubbed, which is the adapter's stub \\(holding Present\\) and lacks it"):
        found.find("f")


LAZY_INIT = '''
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .helpers import scale, OFFSET
else:
    _import_structure = {"helpers": ["scale", "OFFSET"]}
    sys.modules[__name__] = _import_structure  # a lazy module, as transformers' _LazyModule
'''


def test_a_lazy_package_init_is_read_through_its_type_checking_imports(tmp_path, monkeypatch) -> None:
    """A package `__init__` that binds its names lazily at run time (ms-swift's `swift/utils`): each
    name is found by its import under `if TYPE_CHECKING:`, and the statement that binds
    `_import_structure` while reading it is run once, not resolved against itself."""
    tools = tmp_path / "acme" / "tools"
    _tree(tmp_path)
    tools.mkdir()
    (tools / "__init__.py").write_text(LAZY_INIT)
    (tools / "helpers.py").write_text(HELPERS)
    (tmp_path / "acme" / "uses.py").write_text("from acme.tools import scale\n\n\ndef twice(x):\n    return 2 * scale(x)\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    found = PeerSource("acme-lazy", files=("acme/uses.py",), markers=("acme",)).find("twice")
    assert found(3.5) == 8  # 2 * (floor(3.5) + OFFSET), scale read from acme/tools/helpers.py


def test_a_name_rebound_in_terms_of_itself_reads_its_earlier_binding(tmp_path, monkeypatch) -> None:
    """`if ...: f = torch.compile(f)` at a file's top (AReaL's `vocab_parallel.py`): the statement reads
    the `f` bound before it (the `def`), not itself."""
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "wrapped.py").write_text(
        "import os\n\n\ndef f(x):\n    return x + 1\n\n\nif os.sep:\n    f = (lambda g: lambda x: 10 * g(x))(f)\n"
        "\n\ndef twice(x):\n    return 2 * f(x)\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    found = PeerSource("acme-rebound", files=("acme/wrapped.py",), markers=("acme",)).find("twice")
    assert found(1) == 40  # 2 * 10 * (1 + 1): the rebound f, wrapping the def


def test_replays_run_eager(tmp_path) -> None:
    """Each commit's check runs with dynamo off: a trainer's torch.compile costs minutes per commit."""
    started: list[dict[str, str]] = []

    class Git:
        def export(self, sha: str, tree: Path) -> None:
            pass

    class Checks:
        stopped = False

        def start(self, cmd, **popen):
            started.append(popen["env"])
            return None  # as once stopped: nothing runs

    ns = argparse.Namespace(target="t", profile="smoke", tp=[1], device="cpu", seed=None, known=None, commit_timeout=5)
    fake_git, fake_sessions = cast(Any, Git()), cast(Any, Checks())
    outcome = replay.check_commit(fake_git, Commit("a" * 40, "s", "2026-01-01", ""), ns, tmp_path, fake_sessions)
    assert outcome.status == "error" and started and started[0]["TORCHDYNAMO_DISABLE"] == "1"


# ---- over the trainers' own commits (skipped without their histories) ----

def _mirror(variable: str) -> Path:
    repo = Path(os.environ.get(variable, "-"))
    if not (repo / "HEAD").exists() and not (repo / ".git").exists():
        pytest.skip(f"set {variable} to a clone or bare mirror of the trainer's repository")
    return repo


def _at(repo: Path, rev: str, paths: list[str], into: Path, monkeypatch, adapter: str):
    """The adapter imported with `rev`'s files (only `paths`) first on sys.path."""
    tree = into / rev
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, *paths], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    monkeypatch.syspath_prepend(str(tree))
    monkeypatch.delitem(sys.modules, f"harness.targets.peers.{adapter}", raising=False)
    return importlib.import_module(f"harness.targets.peers.{adapter}")


def test_ms_swift_gkd_follows_the_loss_back_to_the_trainer_method(tmp_path, monkeypatch) -> None:
    repo = _mirror("MS_SWIFT_REPO")
    paths = ["swift/megatron/trainers/gkd_trainer.py", "swift/megatron/trainers/vocab_parallel_utils.py"]
    first = _at(repo, "45fde4967", paths[:1], tmp_path, monkeypatch, "ms_swift_gkd")  # #7216: methods only
    assert first._OLD is not None and first.HARNESS.capabilities["given_teacher"] is False
    assert not hasattr(first, "distill_topk") and not hasattr(first, "distill_gather")
    monkeypatch.undo()
    fixed = _at(repo, "e98904c25", paths, tmp_path, monkeypatch, "ms_swift_gkd")  # #8319: the TP top-k methods
    assert fixed._OLD is not None and hasattr(fixed, "distill_topk") and hasattr(fixed, "distill_gather")


def test_verl_distill_on_its_development_branch(tmp_path, monkeypatch) -> None:
    repo = _mirror("VERL_REPO")
    paths = ["verl/trainer/distillation"]
    with pytest.raises(RoutineMissing, match="defines no _VocabParallelKLDivergence"):
        _at(repo, "81e0f80b4", paths, tmp_path, monkeypatch, "verl_distill")  # "Init megatron losses": none yet
    monkeypatch.undo()
    # 86ece2b28 imports verl.trainer.distillation.megatron.utils, whose package imports verl's configs:
    # read file by file, nothing of verl is stubbed.
    branch = _at(repo, "86ece2b28", paths, tmp_path, monkeypatch, "verl_distill")
    assert branch._KL.__name__ == "_VocabParallelKLDivergence"


def test_nemo_rl_distill_before_and_at_its_distillation(tmp_path, monkeypatch) -> None:
    repo = _mirror("NEMO_RL_REPO")
    paths = ["nemo_rl/distributed", "nemo_rl/algorithms"]
    with pytest.raises(RoutineMissing, match="before its distillation"):
        _at(repo, "c594dfa4a", paths, tmp_path, monkeypatch, "nemo_rl_distill")
    monkeypatch.undo()
    first = _at(repo, "17ea9abfb", paths, tmp_path, monkeypatch, "nemo_rl_distill")  # #1006: the loss takes logits
    assert first._FROM_LOGITS and hasattr(first, "distill_divergence") and not hasattr(first, "distill_gather")


def _repro_at(repo: Path, rev: str, paths: list[str], into: Path, target: str, case: str) -> subprocess.CompletedProcess:
    """`harness repro` of one case against `rev`'s files, in a process of its own (as `history` runs it)."""
    tree = into / rev
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, *paths], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(Path(__file__).resolve().parents[1])])}
    return subprocess.run([sys.executable, "-m", "harness", "repro", "--target", target, case], env=env,
                          capture_output=True, text=True, timeout=600, check=False)


def test_nemo_rl_loss_finds_the_chunk_size_its_training_path_dropped_before_2872(tmp_path, monkeypatch) -> None:
    """NeMo-RL #2871/#2872 on the caller, where it was: the training loss's `LossPostProcessor` handed
    `prepare_loss_input` no chunk size until #2872. Before #1920 the loss function computed its own
    log-probs: no caller to call, and the adapter says so."""
    repo = _mirror("NEMO_RL_REPO")
    paths = ["nemo_rl"]
    with pytest.raises(RoutineMissing, match="before #1920"):
        _at(repo, "84bede0e3", paths, tmp_path, monkeypatch, "nemo_rl_loss")
    monkeypatch.undo()
    case = "wrapper:tp=2,v_local=64,total_lengths=9/7,response_lengths=4/3,chunk_size=4,with_entropy=0,dtype=bf16,seed=2153"
    before = _repro_at(repo, "d584a8963", paths, tmp_path, "harness.targets.peers.nemo_rl_loss", case)
    assert before.returncode == 1 and "the configured chunk size did not reach the work on the logits" in before.stdout, \
        before.stdout[-3000:] + before.stderr[-3000:]
    fixed = _repro_at(repo, "f67e9e61d", paths, tmp_path, "harness.targets.peers.nemo_rl_loss", case)
    assert fixed.returncode == 0, fixed.stdout[-3000:] + fixed.stderr[-3000:]
