"""Every registered check, against --harness-target: the regression corpus, then randomized cases,
as `harness check` runs them with the same profile (`exploration`).

One test id per level of the corpus (`test_corpus[kernel]`) and per check x family of randomized
cases (`test_check[values-kernel-tp2]`, `test_check[cp-invariance-wrapper-tp1-cp2]`), so
`pytest -k 'tp2 and gradients'` selects. A check that cannot apply to a family on this target is
skipped before any case is drawn, saying why; a failing check prints its shrunk case and repro line.
"""
from __future__ import annotations

import pytest

from harness.base.errors import TargetError
from harness.cases.profiles import PROFILES
from harness.checks import all_checks
from harness.conformance.exploration import CheckOutcome, Family, Session, families
from harness.plugin import launched, value
from harness.report.console import finding_blocks
from harness.targets import load_target


def _target(config: pytest.Config):
    try:
        return load_target(value(config, "target"))
    except TargetError as e:
        raise pytest.UsageError(f"harness: error: {e}") from None


def _families(config: pytest.Config, target) -> list[Family]:
    cp = value(config, "cp") if target.supports("context_parallel") else []
    return families(PROFILES[value(config, "profile")], target.levels, value(config, "tp"),
                    launched(config) is not None, cp)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    config = metafunc.config
    if "corpus_level" in metafunc.fixturenames:
        metafunc.parametrize("corpus_level", _target(config).levels)
    if "family" not in metafunc.fixturenames:
        return
    target = _target(config)
    params = []
    for fam in _families(config, target):
        for name, chk in all_checks(bitwise=value(config, "bitwise")).items():
            if fam.level not in chk.levels or fam.tp * fam.cp < chk.min_ranks:
                continue  # cannot fail there at all: no test
            why = chk.excluded(target, fam.tp, fam.cp)
            params.append(pytest.param(name, fam, id=f"{name}-{fam.id}",
                                       marks=[pytest.mark.skip(reason=f"{name}: {why}")] if why else []))
    metafunc.parametrize(("check_name", "family"), params)


@pytest.fixture(scope="session")
def harness_session(request: pytest.FixtureRequest, harness_runner) -> Session:
    """The session's explorations, each for the checks the session selected of its family."""
    selected: dict[str, set[str]] = {}
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "family" in params:
            selected.setdefault(params["family"].id, set()).add(params["check_name"])
    return Session(harness_runner, value(request.config, "seed"), selected,
                   first_only=request.config.getoption("maxfail") == 1)


def test_corpus(harness_session: Session, request: pytest.FixtureRequest, corpus_level: str) -> None:
    """The regression corpus's cases of this level: every defect the field has had, as a case."""
    outcomes = harness_session.corpus(corpus_level, value(request.config, "tp"))
    _conclude(request, [f for o in outcomes.values() for f in o.findings],
              [name for name, o in outcomes.items() if o.known], f"the corpus's {corpus_level} cases")


def test_check(harness_session: Session, request: pytest.FixtureRequest, check_name: str, family: Family) -> None:
    outcome: CheckOutcome = harness_session.family(family)[check_name]
    if not outcome.applied and not outcome.findings and not outcome.known:
        why = "; ".join(f"{n} case(s) {note}" for note, n in sorted(outcome.not_applied.items()))
        pytest.skip(f"{check_name}: applied to none of the {family.cases} {family.id} cases drawn"
                    + (f" ({why})" if why else ""))
    _conclude(request, outcome.findings, [check_name] if outcome.known else [], f"{check_name} on {family.id}")


def _conclude(request: pytest.FixtureRequest, findings: list, known: list[str], what: str) -> None:
    """Fail with the findings as `harness check` prints them (shrunk case first, repro line);
    only known findings (of the checks `known`): an expected failure, a failure with
    --harness-strict-known."""
    if findings:
        pytest.fail("\n".join(finding_blocks(findings)).strip(), pytrace=False)
    if known:
        reason = f"known findings (--harness-known) in {what}"
        runner = request.getfixturevalue("harness_runner")
        matched = [f for f in runner.verdicts.known_findings if f.known and f.check in known]
        if matched:
            reason = f"known: {matched[-1].known}; e.g. {matched[-1].repro}"
        if value(request.config, "strict_known"):
            pytest.fail(f"{reason} (--harness-strict-known)", pytrace=False)
        pytest.xfail(reason)
