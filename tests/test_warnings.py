"""Warnings during a case: the routine's, under a warnings-as-errors configuration, are `warning`
findings with their category (never a `crash`); the harness's own adapter code's are never the
routine's."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import harness
from harness.engine import warnings_seen
from harness.engine.warnings_seen import sorted_warnings

HARNESS = Path(harness.__file__).resolve().parent


def _warn_from(path: Path, category: type[Warning] = FutureWarning) -> None:
    """Raise a warning whose calling frame is in `path` (as code of that file would)."""
    code = compile(f"import warnings\nwarnings.warn('deprecated call', {category.__name__})\n", str(path), "exec")
    exec(code, {category.__name__: category})  # noqa: S102 - a frame of a chosen file, nothing else


def test_a_routine_warning_under_error_filters_is_kept_and_does_not_raise(tmp_path):
    routine = tmp_path / "routine.py"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sorted_warnings() as kept:
            _warn_from(routine)  # raises FutureWarning as an error without the sorting
    assert [w.category for w in kept] == ["FutureWarning"]
    assert kept[0].where.endswith("routine.py:2") and "deprecated call" in str(kept[0])


def test_a_routine_warning_the_filters_leave_a_warning_is_not_a_finding(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.filterwarnings("error", category=UserWarning)
        with sorted_warnings() as kept:
            _warn_from(tmp_path / "routine.py", FutureWarning)
    assert kept == []


@pytest.mark.parametrize("own", ["targets/peers/some_adapter.py", "engine/executor.py"])
def test_the_harness_own_warnings_are_never_the_routine(own):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sorted_warnings() as kept:
            _warn_from(HARNESS / own)
    assert kept == []


def test_the_shipped_routines_count_as_routines():
    assert not warnings_seen.harness_file(str(HARNESS / "targets" / "fused.py"))
    assert not warnings_seen.harness_file(str(HARNESS / "targets" / "mutants" / "faults.py"))
    assert warnings_seen.harness_file(str(HARNESS / "targets" / "peers" / "nemo_rl.py"))


def test_the_caller_is_the_innermost_frame_outside_torch_and_the_standard_library():
    torch_file = str(Path(warnings_seen.torch.__file__).parent / "distributed" / "nn" / "functional.py")
    frames = [(warnings.__file__, 10), (torch_file, 61), ("/src/nemo_rl/model_utils.py", 5), (__file__, 1)]
    assert warnings_seen.caller(frames) == ("/src/nemo_rl/model_utils.py", 5)


def test_the_filters_decide_as_the_warnings_module_does():
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.filterwarnings("error", message="deprecated", category=FutureWarning)
        warnings.filterwarnings("ignore", category=FutureWarning, module="quiet")
        filters = list(warnings.filters)
    assert warnings_seen.action(filters, FutureWarning, "deprecated call", "m", 1) == "error"
    assert warnings_seen.action(filters, FutureWarning, "other", "quiet.mod", 1) == "ignore"
    assert warnings_seen.action(filters, UserWarning, "deprecated call", "m", 1) == warnings.defaultaction
