"""The performance gate (harness.perf.timing, harness.perf.gate, harness.perf.callgrind): its statistics, and
each of its four checks failing on a routine that breaks it while the clean routine passes.

Fast tests use two benchmark cases (TP 1 and TP 2) with the callgrind counter switched off, and
time only the clean routine against itself in pairs; the instruction counter, the CLI and the
whole "Done when" comparison take minutes and are marked `slow`.
"""
from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest

from harness.base.errors import UsageError
from harness.base.options import DEFAULT_TARGET
from harness.cases.benchmarks import PERF_CASES
from harness.cases.case import parse_case
from harness.driver.runner import Runner
from harness.perf import callgrind as instructions
from harness.perf import commits
from harness.perf import gate as baseline
from harness.perf import timing as perf
from harness.perf.jobs import PAIRED_JOB

FAST_CASES = [PERF_CASES[2], PERF_CASES[4]]  # TP 1 chunked log-prob, TP 2 bf16 log-prob
SLOW_MUTANT = "mutant:needless-exp-pass"
ALLREDUCE_MUTANT = "mutant:extra-allreduce-per-call"


# ---------------------------------------------------------------------------- statistics
def _binom_cdf(k: int, n: int) -> float:
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


@pytest.mark.parametrize("n", [10, 30, 60, 200])
def test_median_interval_is_the_tightest_with_95_percent_coverage(n):
    lo, hi = perf.median_ci_ranks(n)
    assert hi == n - 1 - lo
    assert 1 - 2 * _binom_cdf(lo, n) >= 0.95  # the interval [x_(lo), x_(hi)] covers the median
    assert 1 - 2 * _binom_cdf(lo + 1, n) < 0.95  # one rank tighter would not


def test_interval_covers_the_true_ratio_under_skewed_noise():
    rng = random.Random(1)
    covered = 0
    for _ in range(400):
        # Interference only adds time: heavy right tails on both sides of every pair.
        pairs = [(1.0 + rng.expovariate(8), 1.1 * (1.0 + rng.expovariate(8))) for _ in range(perf.PAIRS)]
        r = perf.paired_ratio(pairs)
        covered += r.low <= 1.1 <= r.high
    assert covered / 400 >= 0.93


def test_verdict_flags_only_an_interval_wholly_beyond_half_the_threshold():
    def ratio(low, high):
        return perf.Ratio((low + high) / 2, low, high, 30, 1.0, 1.0)

    assert ratio(1.06, 1.14).verdict(0.10) == "slower"
    assert ratio(1.04, 1.14).verdict(0.10) == "unchanged"  # could be a 4% change: not significant beyond 5%
    assert ratio(0.97, 1.03).verdict(0.10) == "unchanged"
    assert ratio(0.86, 0.94).verdict(0.10) == "faster"
    assert ratio(1.11, 1.19).verdict(0.30) == "unchanged"  # a looser threshold moves the line to 15%


# ---------------------------------------------------------------------------- timing on the pools
def test_paired_timing_sees_an_injected_slowdown_and_not_a_null_one(harness_pools):
    # Through the gate's own call, with its deadline: a timing job is not bounded by a case's.
    runner, case = Runner(DEFAULT_TARGET, pools=harness_pools), PERF_CASES[2]
    same = perf.paired_ratio(baseline.pool_values(runner, case, PAIRED_JOB, case, DEFAULT_TARGET, DEFAULT_TARGET))
    slowed = perf.paired_ratio(baseline.pool_values(runner, case, PAIRED_JOB, case, DEFAULT_TARGET, DEFAULT_TARGET,
                                                     perf.PAIRS, 0, "cpu", 0.5))
    assert same.verdict(0.10) != "slower"
    assert slowed.verdict(0.10) == "slower"
    # 1.5 by construction; the busy loop overshoots a little on a loaded machine (1.75 measured beside a
    # second test worker), never by the half of a second slowdown.
    assert 1.3 < slowed.median < 2.0


# ---------------------------------------------------------------------------- the baseline gate
@pytest.fixture(scope="module")
def clean_baseline(harness_pools) -> dict:
    with pytest.MonkeyPatch.context() as mp:  # undone on return: the slow tests count for real
        mp.setattr(instructions, "available", lambda: "switched off in the fast tests")
        return baseline.record(Runner(DEFAULT_TARGET, pools=harness_pools), FAST_CASES)


@pytest.fixture(scope="module")
def unpaired_baseline(clean_baseline) -> dict:
    """The same figures from code that is no longer here: time is shown, not judged (and not paired,
    which keeps these tests to seconds)."""
    return {**clean_baseline, "code": "0" * 64}


def _checks(cmp: baseline.Comparison) -> set[str]:
    return {f.check for f in cmp.findings}


def test_baseline_records_every_figure(clean_baseline):
    assert clean_baseline["format"] == baseline.FORMAT
    for entry in clean_baseline["cases"]:
        assert entry["time_s"] > 0
        assert isinstance(entry["collectives"], dict)
        assert {"retained_bytes", "peak_forward_bytes", "peak_backward_bytes", "peak_bytes"} <= entry["memory"].keys()
    assert clean_baseline["cases"][1]["collectives"] == {"all_reduce": 2}
    json.dumps(clean_baseline)  # saved as JSON as it is


def test_clean_routine_passes_its_own_baseline(harness_pools, clean_baseline):
    cmp = baseline.compare(Runner(DEFAULT_TARGET, pools=harness_pools), clean_baseline)
    assert cmp.reference == DEFAULT_TARGET  # the code is unchanged, so time is paired against it
    assert not cmp.findings, [f.message for f in cmp.findings]
    assert {r["metric"] for r in cmp.rows} == {"time (ms)", "collectives", "retained bytes", "peak bytes"}
    assert all(r["ci"] for r in cmp.rows if r["metric"] == "time (ms)")


def test_extra_allreduce_is_flagged(harness_pools, unpaired_baseline):
    cmp = baseline.compare(Runner(ALLREDUCE_MUTANT, pools=harness_pools), unpaired_baseline)
    assert [(f.check, f.case) for f in cmp.findings] == [("perf-collectives", FAST_CASES[1].spec())]
    assert "all_reduce 2 -> 3" in cmp.findings[0].message


def test_memory_increase_is_flagged(harness_pools, unpaired_baseline):
    shrunk = json.loads(json.dumps(unpaired_baseline))
    shrunk["cases"][0]["memory"]["peak_backward_bytes"] -= 1  # the target now needs one byte more
    cmp = baseline.compare(Runner(DEFAULT_TARGET, pools=harness_pools), shrunk)
    assert [f.check for f in cmp.findings] == ["perf-memory"]
    assert "peak_backward_bytes" in cmp.findings[0].message


def test_baseline_of_the_other_ledger_compares_no_memory(harness_pools, unpaired_baseline):
    """The ledgers' difference is not a regression: the comparison says so instead of a finding."""
    assert unpaired_baseline["memory_ledger"] in ("cpp", "python")
    other = json.loads(json.dumps(unpaired_baseline))
    other["cases"][0]["memory"]["peak_backward_bytes"] -= 1
    other["memory_ledger"] = {"cpp": "python", "python": "cpp"}[unpaired_baseline["memory_ledger"]]
    cmp = baseline.compare(Runner(DEFAULT_TARGET, pools=harness_pools), other)
    assert not cmp.findings, [f.message for f in cmp.findings]
    assert any(n.startswith(f"memory: not compared, the baseline was measured by the {other['memory_ledger']} ledger")
               for n in cmp.notes), cmp.notes
    assert not any(r["metric"] in ("retained bytes", "peak bytes") for r in cmp.rows)


def test_comparison_does_not_depend_on_the_module_name(harness_pools, clean_baseline):
    elsewhere = {**clean_baseline, "target": "some_other_package.logprobs"}
    cmp = baseline.compare(Runner(ALLREDUCE_MUTANT, pools=harness_pools), elsewhere)
    assert {f.check for f in cmp.findings} == {"perf-collectives"}  # matched by case, not by module
    assert cmp.reference is None  # the recorded routine is not importable: time is shown, not judged
    assert all(r["verdict"] == "not judged (unpaired)" for r in cmp.rows if r["metric"] == "time (ms)")
    assert "cannot be imported" in cmp.note


def test_report_json_and_markdown(harness_pools, unpaired_baseline):
    cmp = baseline.compare(Runner(ALLREDUCE_MUTANT, pools=harness_pools), unpaired_baseline)
    data = json.loads(json.dumps(cmp.to_json()))
    assert {"case", "metric", "before", "after", "ratio", "verdict", "bad"} <= data["rows"][0].keys()
    md = data["markdown"]
    assert "| case | metric | before | after | ratio | verdict |" in md
    assert "**more**" in md and md.count("\n|") == len(data["rows"]) + 2  # header, rule, rows


def test_cli_options(tmp_path):
    from harness.cli import build_parser

    ns = build_parser().parse_args(["check", "--baseline", "b.json", "--slowdown-threshold", "0.2"])
    assert ns.baseline == "b.json" and ns.slowdown_threshold == 0.2 and ns.save_baseline is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["check", "--slowdown-threshold", "10"])
    bogus = tmp_path / "not-a-baseline.json"
    bogus.write_text("{}")

    with pytest.raises(UsageError):
        baseline.load(bogus)


# ---------------------------------------------------------------------------- slow: minutes each
needs_valgrind = pytest.mark.skipif(instructions.available() is not None,
                                    reason=f"callgrind unavailable: {instructions.available()}")


@pytest.mark.slow
@needs_valgrind
def test_instruction_counts_repeat_and_see_a_needless_pass():
    cases = [c for c in PERF_CASES if c.tp == 1]
    first = instructions.count(DEFAULT_TARGET, cases)
    again = instructions.count(DEFAULT_TARGET, cases)
    slow = instructions.count(SLOW_MUTANT, cases)
    assert first["environment"] == again["environment"]
    for spec in first["cases"]:
        a, b = first["cases"][spec]["instructions"], again["cases"][spec]["instructions"]
        # Load does not move counts; the heap layout does (a source edit between the two runs moved
        # one count by 0.1%). docs/performance.md: mostly identical, always within 0.2%.
        assert abs(a - b) <= 2e-3 * a
        assert slow["cases"][spec]["instructions"] > 1.05 * a


@pytest.mark.slow
@needs_valgrind
def test_done_when_mutants_flagged_and_clean_not(harness_pools):
    """The issue's last criterion, on every benchmark case at TP 1, 2 and 4."""
    clean = baseline.record(Runner(DEFAULT_TARGET, pools=harness_pools), list(PERF_CASES))
    assert all("instructions" in e for e in clean["cases"] if parse_case(e["case"]).tp == 1)
    same = baseline.compare(Runner(DEFAULT_TARGET, pools=harness_pools), clean)
    assert not same.findings, [f.message for f in same.findings]
    slow = baseline.compare(Runner(SLOW_MUTANT, pools=harness_pools), clean)
    assert "perf-instructions" in _checks(slow)
    extra = baseline.compare(Runner(ALLREDUCE_MUTANT, pools=harness_pools), clean)
    assert "perf-collectives" in _checks(extra)


@pytest.mark.slow
@needs_valgrind
def test_cli_save_then_compare(tmp_path):
    base = tmp_path / "base.json"
    common = [sys.executable, "-m", "harness", "check", "--profile", "smoke", "--tp", "1", "-q"]
    saved = subprocess.run([*common, "--save-baseline", str(base)], capture_output=True, text=True, timeout=900)
    assert saved.returncode == 0, saved.stderr[-3000:]
    out = tmp_path / "result.json"
    mutant = subprocess.run([*common, "--target", SLOW_MUTANT, "--baseline", str(base), "--json", str(out)],
                            capture_output=True, text=True, timeout=900)
    assert mutant.returncode == 1, mutant.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"perf-instructions"} <= {f["check"] for f in result["findings"]}
    assert "| case | metric | before | after | ratio | verdict |" in result["baseline"]["markdown"]


# ---------------------------------------------------------------------------- commit against commit (history --perf)
def _record(cases: list[dict], environment: dict | None = None, ledger: str = "cpp") -> dict:
    return {"format": baseline.FORMAT, "environment": environment or {"python": "3"}, "memory_ledger": ledger,
            "cases": cases}


def _entry(collectives: dict, memory: dict, instructions: int | None = None, paired: dict | None = None) -> dict:
    return {"case": FAST_CASES[0].spec(), "label": baseline.label(FAST_CASES[0]), "collectives": collectives,
            "memory": memory, "time_s": 0.001, **({"instructions": instructions} if instructions else {}),
            **({"paired": paired} if paired else {})}


MEM = {"retained_bytes": 3_148_416, "peak_forward_bytes": 3_150_464, "peak_backward_bytes": 4_721_796}


def test_commit_changes_both_ways_with_the_gates_thresholds():
    """slime #2144's figures (TP 1, fp32): one all-reduce fewer, retained memory a third, the backward
    peak larger; instructions moved by 0.2% are no change, by 8% one; time only where paired."""
    fused = {"retained_bytes": 1_051_264, "peak_forward_bytes": 3_149_440, "peak_backward_bytes": 5_248_132}
    slower = {"verdict": "slower", "ratio": 1.12, "ci": [1.08, 1.15], "old_s": 0.002, "new_s": 0.00224}
    before = _record([_entry({"all_reduce": 5}, MEM, 5_000_000)])
    after = _record([_entry({"all_reduce": 4}, fused, 5_010_000, slower)])
    got = commits.changes(before, after, paired=True)
    found = {(c["metric"], c["direction"]) for c in got["changes"]}
    assert found == {("all_reduce per call", "improvement"), ("retained bytes", "improvement"),
                     ("peak forward bytes", "improvement"), ("peak backward bytes", "regression"),
                     ("time (ms)", "regression")}
    assert all({"metric", "case", "before", "after", "ratio", "direction"} <= c.keys() for c in got["changes"])
    unpaired = commits.changes(before, after, paired=False)
    assert "time (ms)" not in {c["metric"] for c in unpaired["changes"]} and "time: not judged (unpaired)" in unpaired["notes"]
    more = commits.changes(before, _record([_entry({"all_reduce": 5}, MEM, 5_400_000)]), paired=True)
    assert [(c["metric"], c["direction"], round(c["ratio"], 2)) for c in more["changes"]] == [("instructions", "regression", 1.08)]
    other_env = commits.changes(before, _record([_entry({"all_reduce": 5}, MEM, 9_000_000)], {"python": "4"}), paired=True)
    assert not other_env["changes"] and other_env["notes"][0].startswith("instructions: not compared")
    assert commits.summary(got["changes"]).startswith("regression: peak backward bytes x1.11 (1 case), time (ms) x1.12")


def test_callgrind_failure_says_what_failed():
    err = ("Traceback (most recent call last):\n  File \"x.py\", line 3, in <module>\n"
           "ValueError: Default process group has not been initialized\n==21551== \n==21551== Events    : Ir\n"
           "==21551== Collected : 0\n==21551== I   refs:      0\n")
    tail = instructions.stderr_tail("", err)
    assert tail.endswith("ValueError: Default process group has not been initialized") and "==" not in tail


def _tree(root, name: str, source: str):
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{name}.py").write_text(source)
    return root


def test_an_aliased_tree_keeps_its_own_modules_beside_the_current_ones(tmp_path, monkeypatch):
    """The old tree's module and the modules it imports later, inside a call, are the old tree's;
    the current ones stay in sys.modules."""
    from harness.perf import aliased

    for version in ("old", "new"):
        pkg = tmp_path / version / "aliaspkg"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("from aliaspkg.helper import VERSION as _imported_while_executing\n")
        (pkg / "helper.py").write_text(f"VERSION = {version!r}\n")
        (pkg / "lp.py").write_text("def which():\n    from aliaspkg.helper import VERSION\n    return VERSION\n")
    monkeypatch.syspath_prepend(str(tmp_path / "new"))
    import importlib

    current = importlib.import_module("aliaspkg.lp")
    old = aliased.load(str(tmp_path / "old"), "aliaspkg.lp")
    assert old["which"]() == "old" and current.which() == "new"
    assert sys.modules["aliaspkg.lp"] is current and sys.modules["aliaspkg.helper"].VERSION == "new"
    shim = aliased.write_shim(tmp_path / "old", "aliaspkg.lp", tmp_path / "aliases", "abc")
    assert "aliaspkg.lp" in shim.read_text() and shim.stem.isidentifier()
    for name in [m for m in sys.modules if m.split(".")[0] == "aliaspkg"]:
        monkeypatch.delitem(sys.modules, name)


@pytest.fixture(scope="module")
def routine_trees(tmp_path_factory):
    """The built-in routine's source in two trees, and a tree of the needless-pass mutant, each as
    module `perf_twin` (a routine of its own: the classes are defined anew in each)."""
    from pathlib import Path

    import harness.targets.fused as fused_module

    source = Path(fused_module.__file__).read_text()
    root = tmp_path_factory.mktemp("perf-trees")
    mutant = ("from harness.targets.mutants import mutant_namespace\n\n"
              "calculate_log_probs_and_entropy = mutant_namespace('needless-exp-pass').calculate_log_probs_and_entropy\n")
    return {name: _tree(root / name, "perf_twin", text)
            for name, text in (("a", source), ("b", source), ("mutant", mutant))}


def _shim(tmp_path, tree, tag: str) -> str:
    from harness.perf import aliased

    return str(aliased.write_shim(tree, "perf_twin", tmp_path / "aliases", tag))


def _paired_record(pools, target: str, reference: str | None, cases) -> dict:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(instructions, "available", lambda: "switched off in the fast tests")
        return baseline.record(Runner(target, pools=pools), cases, reference=reference)


def test_identical_trees_give_no_change_and_a_perf_mutant_a_regression(harness_pools, routine_trees, tmp_path):
    """One repeat of what `history --perf` does per commit, on one TP 1 case: each tree's module
    `perf_twin` imported under a name of its own, the newer timed against the older (the ten-repeat
    run over whole histories is `test_history.py::test_identical_commits_give_no_perf_change_over_ten_repeats`)."""
    cases = [FAST_CASES[0]]
    a, b = _shim(tmp_path, routine_trees["a"], "a"), _shim(tmp_path, routine_trees["b"], "b")
    before = _paired_record(harness_pools, b, None, cases)
    same = _paired_record(harness_pools, a, b, cases)
    assert same["cases"][0]["paired"]["verdict"] == "unchanged", same["cases"][0]["paired"]
    assert commits.changes(before, same, paired=True)["changes"] == []
    worse = _paired_record(harness_pools, _shim(tmp_path, routine_trees["mutant"], "m"), a, cases)
    got = commits.changes(same, worse, paired=True)["changes"]
    # The thrown-away pass allocates a full-size temporary: deterministic, whatever the load.
    assert ("peak forward bytes", "regression") in {(c["metric"], c["direction"]) for c in got}
    assert all(c["direction"] == "regression" for c in got)
