"""pytest-benchmark benchmarks: one forward+backward of the target's kernel per benchmark case
(`cases.benchmarks.PERF_CASES`: T x V_local x TP x dtype x entropy settings). Not collected by a plain
`pytest` (testpaths = tests); run them by path:

    pytest benchmarks --benchmark-save=main
    pytest benchmarks --benchmark-compare --benchmark-compare-fail=median:10%
    pytest benchmarks --harness-target mypkg.logprobs ...   # any target, as for the conformance suite

TP 1 runs in this process on one thread; TP > 1 is timed from here around one call on every rank
of the session's worker pool (dispatch to the ranks included, about 0.1 ms), so keep the default
wall-clock timer: a CPU-time timer would see only this idle driver. Each benchmark's
`extra_info` holds the case's deterministic figures: collectives per call (`collectives`,
`collective_count`), memory (`retained_bytes`, `peak_bytes`, ...), and at TP 1 the callgrind
instruction count (`instructions`) when valgrind is installed. pytest-benchmark compares times
only, and saved times on a shared machine drift by 30%: `python -m harness check --baseline` is
the gate that judges the deterministic figures and pairs the timings (docs/performance.md).
"""
from __future__ import annotations

import pytest
import torch

from harness.cases.benchmarks import PERF_CASES
from harness.engine.calls import prepared_call
from harness.engine.observations import RankResult
from harness.perf import callgrind as instructions
from harness.perf import timing as perf
from harness.perf.gate import collective_counts, label, memory_figures
from harness.perf.jobs import CALL_JOB

pytestmark = pytest.mark.perf


@pytest.fixture(scope="session")
def instruction_counts(harness_runner) -> dict:
    """Instruction counts of every TP 1 case, counted together in one callgrind run."""
    cases = [c for c in PERF_CASES if c.tp == 1]
    if instructions.available() or harness_runner.device != "cpu" or harness_runner.target.kernel is None:
        return {}
    return instructions.count(harness_runner.target.spec, cases)["cases"]


@pytest.mark.parametrize("case", PERF_CASES, ids=lambda c: label(c).replace(" ", "-"))
def test_forward_backward(benchmark, harness_runner, instruction_counts, case) -> None:
    runner = harness_runner
    if runner.target.kernel is None:
        pytest.skip(f"{runner.target.spec} has no kernel")
    ev = runner.run(case)
    assert not ev.failed_ranks, ev.failed_ranks[0].error
    collectives = collective_counts(ev.ranks)
    benchmark.extra_info.update(case=case.spec(), tp=case.tp, T=case.T, v_local=case.v_local, dtype=case.dtype,
                                collectives=collectives, collective_count=sum(collectives.values()),
                                **memory_figures(ev.ranks))
    if case.spec() in instruction_counts:
        benchmark.extra_info["instructions"] = instruction_counts[case.spec()]["instructions"]
    if case.tp == 1 and runner.device == "cpu":
        torch.set_num_threads(1)  # as in the worker pools: one thread, no contention between threads
        perf.steady_allocator()
        benchmark(prepared_call(runner.target, case, 0, torch.device("cpu"), None))
    else:
        replies = benchmark(runner.pool(case.tp).run, CALL_JOB, case, runner.target.spec)
        errors = [r.error for r in replies if isinstance(r, RankResult)]
        assert not errors, errors[0]
