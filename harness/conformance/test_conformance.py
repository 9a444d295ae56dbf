"""Every registered check, against --harness-target: `harness check`'s run with the same profile and
seed, in its order (`exploration`): the regression corpus, entry by entry, then randomized cases,
step by step.

One test id per corpus entry (`test_corpus[wrapper-coef-zero-metric-only]`) and per check x step of
randomized cases (`test_check[values-kernel-tp1-tp2-tp4]`, `test_check[gradients-kernel-tp2-dp2]`,
`test_check[cp-invariance-wrapper-tp1-tp2-cp2]`), so `pytest -k 'tp2 and gradients'` selects. A
check that cannot apply to a step on this target is skipped before any case is drawn, saying why; a
failing check prints its shrunk case and repro line, as `check` prints it. A test fails when its
findings are what `--harness-fail-on` (ini `harness_fail_on`) fails `check` on, so the session's exit
code is `check`'s gate: new findings (the default); any, known ones included; or in-use, new findings
in the target's use (those beyond it only: an expected failure, `-rx` lists them).
"""
from __future__ import annotations

import pytest

from harness.base.errors import TargetError
from harness.cases.profiles import PROFILES
from harness.checks import all_checks
from harness.checks.findings import gated
from harness.conformance.exploration import CheckOutcome, Session, Step, steps
from harness.driver.explorer import corpus_cases
from harness.plugin import PARTIAL, launched, target_spec, unrewritten_imports, value
from harness.report.console import finding_blocks
from harness.targets import load_target


def _target(config: pytest.Config):
    try:
        with unrewritten_imports():  # the target's import, and its trainer's stack
            return load_target(target_spec(config))
    except TargetError as e:
        raise pytest.UsageError(f"harness: error: {e}") from None


def _steps(config: pytest.Config, target) -> list[Step]:
    cp = value(config, "cp") if target.supports("context_parallel") else []
    return steps(PROFILES[value(config, "profile")], target.levels, value(config, "tp"), launched(config) is not None, cp)


def _checks_of(config: pytest.Config, target, step: Step) -> dict[str, str | None]:
    """The checks that may fail on some case of the step, each with why it cannot on this target
    (None: it can)."""
    out = {}
    for name, chk in all_checks(bitwise=value(config, "bitwise")).items():
        sizes = [tp for tp in step.tps if tp * step.cp >= chk.min_ranks]
        if step.level not in chk.levels or not sizes:
            continue  # cannot fail there at all: no test
        whys = [chk.excluded(target, tp, step.cp) for tp in sizes]
        out[name] = whys[0] if all(whys) else None
    return out


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    config = metafunc.config
    if "corpus_case" in metafunc.fixturenames:
        target = _target(config)
        metafunc.parametrize("corpus_case", [pytest.param((name, case), id=f"{case.level}-{name}")
                                             for name, case in corpus_cases(target.levels, value(config, "tp"))])
    if "step" not in metafunc.fixturenames:
        return
    target = _target(config)
    params = []
    for step in _steps(config, target):
        for name, why in _checks_of(config, target, step).items():
            params.append(pytest.param(name, step, id=f"{name}-{step.id}",
                                       marks=[pytest.mark.skip(reason=f"{name}: {why}")] if why else []))
    metafunc.parametrize(("check_name", "step"), params)


@pytest.fixture(scope="session")
def harness_session(request: pytest.FixtureRequest, harness_runner) -> Session:
    """The session's explorations, each for the checks the session selected of its step."""
    selected: dict[str, set[str]] = {}
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "step" in params:
            selected.setdefault(params["step"].id, set()).add(params["check_name"])
    return Session(harness_runner, value(request.config, "seed"), selected,
                   first_only=request.config.getoption("maxfail") == 1)


def test_corpus(harness_session: Session, request: pytest.FixtureRequest, corpus_case) -> None:
    """One entry of the regression corpus: a defect the field has had, as a case."""
    name, case = corpus_case
    skipped, outcomes = harness_session.corpus(name, case)
    if skipped:
        pytest.skip(f"corpus {name}: {skipped}")
    _conclude(request, harness_session.reported([f for o in outcomes.values() for f in o.findings]),
              [n for n, o in outcomes.items() if o.known], f"the corpus's {name}")


def test_check(harness_session: Session, request: pytest.FixtureRequest, check_name: str, step: Step) -> None:
    target = request.getfixturevalue("harness_runner").target
    outcome: CheckOutcome = harness_session.step(step, set(_checks_of(request.config, target, step)))[check_name]
    findings = harness_session.reported(outcome.findings)
    if not findings and not outcome.known and harness_session.stopped:
        # no failing test need have stopped the session (under in-use, its first finding may be beyond the use)
        request.config.stash[PARTIAL] = "the exploration stopped at the session's first finding (-x)"
        pytest.skip(f"{check_name} on {step.id}: not concluded, the exploration stopped at the session's first "
                    f"finding (-x)")
    if not outcome.applied and not outcome.findings and not outcome.known:
        why = "; ".join(f"{n} case(s) {note}" for note, n in sorted(outcome.not_applied.items()))
        pytest.skip(f"{check_name}: applied to none of the {step.cases} {step.id} cases drawn"
                    + (f" ({why})" if why else ""))
    _conclude(request, findings, [check_name] if outcome.known else [], f"{check_name} on {step.id}")


def _conclude(request: pytest.FixtureRequest, findings: list, known: list[str], what: str) -> None:
    """A test fails when its findings are what `--harness-fail-on` fails a `check` run on, with
    all of them as `check` prints them (shrunk case first, repro line). Under in-use, new findings
    beyond the target's use only: an expected failure naming them. Known findings only (of the
    checks `known`): an expected failure, a failure with --harness-strict-known or under any."""
    fail_on = value(request.config, "fail_on")
    if gated(findings, fail_on):
        pytest.fail("\n".join(finding_blocks(findings)).strip(), pytrace=False)
    if findings:
        pytest.xfail(f"{len(findings)} new finding(s) beyond the target's use (--harness-fail-on {fail_on}): "
                     f"{findings[0].beyond}; e.g. {findings[0].repro}")
    if known:
        reason = f"known findings (--harness-known) in {what}"
        runner = request.getfixturevalue("harness_runner")
        matched = [f for f in runner.verdicts.known_findings if f.known and f.check in known]
        if matched:
            reason = f"known: {matched[-1].known}; e.g. {matched[-1].repro}"
        if fail_on == "any":
            pytest.fail(f"{reason} (--harness-fail-on any)", pytrace=False)
        if value(request.config, "strict_known"):
            pytest.fail(f"{reason} (--harness-strict-known)", pytrace=False)
        pytest.xfail(reason)
