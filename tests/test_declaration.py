"""A target's declaration (`harness.targets.declaration`): `HARNESS = Declaration(...)`, or the loose
globals of the older form, which give the same declaration and one DeprecationWarning per module
(a line on stderr where warnings are errors); both at once is refused. Every shipped target and
peer adapter declares itself the typed way."""
from __future__ import annotations

import importlib
import pkgutil
import warnings
from types import ModuleType, SimpleNamespace

import pytest

from harness.base.errors import TargetError
from harness.targets import load_target
from harness.targets.declaration import Declaration, PeerInfo, declaration_of

USE = [{"where": {"T": 0}, "why": "trainer/batches.py:12: every micro-batch holds tokens"}]
PEER = PeerInfo(requires=("fakepeer",), install="pip install fakepeer", upstream=("fakepeer.ops.log_probs",))


def _script_call(ops, logits, tokens, with_entropy=False, chunk_size=-1):
    return ops.log_probs(logits, tokens), None


SCRIPT = {"name": "fakepeer", "files": {"ops": ("fakepeer/ops.py",)}, "kernel": _script_call, "how": "pip install"}


def _module(name: str, **attributes: object) -> ModuleType:
    module = ModuleType(name)
    module.__dict__.update(attributes)
    return module


def _loose(name: str = "loose_target") -> ModuleType:
    return _module(name, HARNESS_CAPABILITIES={"entropy": False, "cp_gradient": {"cpu": False}},
                   HARNESS_MEMORY_BUDGET={"retained": 1.0}, HARNESS_USE=USE, HARNESS_SCRIPT=SCRIPT,
                   HARNESS_PEER=PEER)


def test_the_loose_globals_give_the_same_declaration() -> None:
    typed = Declaration(capabilities={"entropy": False, "cp_gradient": {"cpu": False}},
                        memory_budget={"retained": 1.0}, use=USE, script=SCRIPT, peer=PEER)
    with pytest.warns(DeprecationWarning):
        assert declaration_of(_loose()) == typed
    assert declaration_of(_module("typed_target", HARNESS=typed)) is typed
    assert declaration_of(_module("bare_target")) == Declaration()
    assert declaration_of(SimpleNamespace(calculate_log_probs_and_entropy=print)) == Declaration()


def test_the_loose_globals_are_said_deprecated_once_per_module() -> None:
    module, other = _loose(), _loose("other_loose_target")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(3):
            declaration_of(module)
        declaration_of(other)
    assert [w.category for w in said] == [DeprecationWarning, DeprecationWarning]
    first = str(said[0].message)
    assert first.startswith("loose_target declares HARNESS_CAPABILITIES, HARNESS_MEMORY_BUDGET, HARNESS_USE, "
                            "HARNESS_SCRIPT, HARNESS_PEER as module globals, a deprecated form: write HARNESS = "
                            "Declaration(capabilities=..., memory_budget=..., use=..., script=..., peer=...)"), first
    assert said[0].filename == __file__  # the line that asked, not the declaration module's own
    assert str(said[1].message).startswith("other_loose_target declares")


def test_warnings_as_errors_get_the_line_on_stderr_and_the_target_still_loads(capsys) -> None:
    module = _module("strict_target", HARNESS_MEMORY_BUDGET={"retained": 2.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert declaration_of(module).memory_budget == {"retained": 2.0}
        assert declaration_of(module).memory_budget == {"retained": 2.0}
    err = capsys.readouterr().err
    assert err.count("DeprecationWarning: strict_target declares HARNESS_MEMORY_BUDGET as module globals") == 1, err


def test_both_forms_at_once_or_a_stray_harness_are_refused() -> None:
    both = _module("both_target", HARNESS=Declaration(), HARNESS_USE=USE, HARNESS_PEER=PEER)
    with pytest.raises(TargetError, match=r"^both_target declares both HARNESS and HARNESS_USE, HARNESS_PEER: "
                                          r"give use=, peer= to its Declaration instead$"):
        declaration_of(both)
    with pytest.raises(TargetError, match=r"^stray_target\.HARNESS is a dict, not a "):
        declaration_of(_module("stray_target", HARNESS={"capabilities": {}}))


def test_every_shipped_target_declares_itself_the_typed_way() -> None:
    """Every peer adapter, the built-in routine and the controls: a `Declaration`, and no warning."""
    import harness.targets.peers as peers_package

    specs = [f"harness.targets.peers.{m.name}" for m in pkgutil.iter_modules(peers_package.__path__)
             if not m.name.startswith("_")]
    controls = ["unshifted", "online", "gather", "twopass_pairwise", "inplace_grad", "autograd_collective"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for spec in specs:
            module = importlib.import_module(spec)
            assert isinstance(getattr(module, "HARNESS", None), Declaration), spec
            assert declaration_of(module).peer is not None, spec
        for spec in ["harness.targets.fused", *(f"tests.controls.{c}" for c in controls)]:
            declared = declaration_of(importlib.import_module(spec))
            assert declared.capabilities == {"wrapper_half_precision": True}, spec
    assert len(specs) >= 19


def test_a_target_is_loaded_with_its_declaration() -> None:
    """The typed form and the loose one reach the target alike (`tests/targets/naive_budget.py`
    keeps the loose form), and the repro script reads a peer's declared call."""
    from harness.checks.script import recipe
    from harness.targets import fused
    from harness.targets.peers import verl

    limited = load_target("tests.targets.limited")
    assert not limited.supports("entropy") and not limited.supports("context_parallel")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert load_target("tests.targets.naive_budget").memory_budget == fused.HARNESS.memory_budget
    how = recipe(load_target("harness.targets.peers.verl"), "kernel")
    assert not isinstance(how, str) and how.call is verl.verl_engine and how.files == verl.FILES
