"""Every registered check, against --target, over randomized cases drawn by Hypothesis.

One test id per check x level x TP size x configuration family, e.g.
`test_check[values-kernel-tp2-bf16-masked]`, so `pytest -k 'tp2 and gradients'` selects.
Cases of one family are drawn identically for every check (derandomized profiles), and the runner
caches each distributed run, so a case runs once however many checks read it.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from cases.strategies import kernel_cases, linear_cases, wrapper_cases
from harness.base.errors import TargetError
from harness.checks import all_checks
from harness.targets import load_target

DTYPES = ("fp32", "bf16", "fp16")


def _families(level: str, tps: list[int], keep_mask: bool, cps: list[int] = ()) -> list[tuple[str, dict]]:
    if level == "kernel":
        masks = (False, True) if keep_mask else (False,)  # a target without a keep mask has no masked family
        return [(f"tp{tp}-{dt}-{'masked' if m else 'unmasked'}", dict(tp=tp, dtype=dt, masked=m))
                for tp in tps for dt in DTYPES for m in masks]
    families = [(f"tp{tp}", dict(tp=tp)) for tp in tps]
    if level == "wrapper":  # --cp: TP x CP worlds, both layouts drawn
        families += [(f"tp{tp}-cp{cp}", dict(tp=tp, cp=cp)) for cp in cps for tp in tps if tp <= 2]
    return families


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "family" not in metafunc.fixturenames:
        return
    config = metafunc.config
    try:
        target = load_target(config.getoption("--target"))
    except TargetError as e:
        raise pytest.UsageError(f"harness: error: {e}") from None
    params, ids = [], []
    for name, chk in all_checks(bitwise=config.getoption("bitwise")).items():
        for level in chk.levels:
            if level not in target.levels:
                continue
            for fam_id, fam in _families(level, config.harness_tp, target.supports("keep_mask"), config.harness_cp):
                if fam["tp"] * fam.get("cp", 1) < chk.min_tp:
                    continue
                params.append((name, level, fam))
                ids.append(f"{name}-{level}-{fam_id}")
    metafunc.parametrize(("check_name", "level", "family"), params, ids=ids)


def _strategy(runner, level: str, family: dict) -> st.SearchStrategy:
    t = runner.target
    caps = dict(entropy=t.supports("entropy"), keep_mask=t.supports("keep_mask"))
    if level == "kernel":
        return kernel_cases(tp=st.just(family["tp"]), dtype=st.just(family["dtype"]), masked=family["masked"], **caps)
    if level == "linear":
        return linear_cases(tp=st.just(family["tp"]), **caps)
    return wrapper_cases(tp=st.just(family["tp"]), cp=st.just(family.get("cp", 1)), **caps)


@pytest.mark.distributed
def test_check(harness_runner, request, check_name: str, level: str, family: dict) -> None:
    __tracebackhide__ = True  # a failure reads as the finding and its repro line, not as this code
    runner = harness_runner
    chk = runner.checks[check_name]
    applied = []

    @settings(max_examples=request.config.harness_profile.pytest_examples)
    @given(st.data())
    def run(data):
        __tracebackhide__ = True
        # Fitted to the target's capabilities before the filter, as the runner will run it.
        case = data.draw(_strategy(runner, level, family).map(runner.fit)
                         .filter(lambda c: chk.applicable(c, runner.target)), label="case")
        _, findings = runner.check(case, only={check_name})
        applied.append(case)
        if findings:
            f = findings[0]
            raise AssertionError(f"[{f.check}] {f.message}\nrepro: {f.repro}")

    seed = request.config.getoption("--seed")
    known_before = len(runner.known_findings), sum(e.matched for e in runner.known.entries)
    try:
        (hyp_seed(seed)(run) if seed is not None else run)()
    except Unsatisfiable:  # e.g. memory-budget for a target that declares no budget
        pytest.skip(f"{check_name} applies to no drawn {level} case of {family} for {runner.target.spec}")
    if sum(e.matched for e in runner.known.entries) > known_before[1]:
        # Only known findings: an expected failure with the entry's reason (--known), a failure under --strict-known.
        f = runner.known_findings[known_before[0]] if len(runner.known_findings) > known_before[0] else None
        reason = f"known: {f.known}; e.g. {f.repro}" if f else "known findings (--known)"
        if request.config.getoption("strict_known"):
            pytest.fail(f"[{check_name}] {reason} (--strict-known)", pytrace=False)
        pytest.xfail(reason)
    assert applied, f"{check_name} never applied to the {level} family {family}"
