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


def test_a_filter_a_library_wrote_as_plain_strings_matches_as_the_warnings_module_does():
    """`warnings.filters` may hold a message or module as a plain string (put there by hand, not
    through filterwarnings): the warnings module compares it for equality, and so does the sorting."""
    filters = [("ignore", "deprecated call", FutureWarning, "some.module", 0), ("error", None, Warning, None, 0)]
    assert warnings_seen.action(filters, FutureWarning, "deprecated call", "some.module", 3) == "ignore"
    assert warnings_seen.action(filters, FutureWarning, "deprecated call!", "some.module", 3) == "error"
    assert warnings_seen.action(filters, FutureWarning, "deprecated call", "other", 3) == "error"


def test_the_interpreters_own_default_filters_pass_a_routine_deprecation_through(tmp_path):
    """Python's default filters hold `default::DeprecationWarning:__main__` with its module as a plain
    string: a routine's DeprecationWarning reaches it, and is no finding (and no exception)."""
    with warnings.catch_warnings():
        warnings.filters[:] = [("default", None, DeprecationWarning, "__main__", 0),
                               ("ignore", None, DeprecationWarning, None, 0)]
        with sorted_warnings() as kept:
            _warn_from(tmp_path / "routine.py", DeprecationWarning)
    assert kept == []
