"""Rank-side timing jobs of the performance gate, run on a case's pool with `pool.run(JOB, ...)`.
The clocks and statistics are `perf.timing`'s; the call timed is the case level's `benchmark`."""
from __future__ import annotations

import gc
import random
from typing import Any, Callable

from harness.base.levels import benchmark_call
from harness.engine.calls import tp_group
from harness.perf.timing import BLOCK, PAIRS, REPEATS, WARMUP_CALLS, Timer, steady_allocator, with_overhead
from harness.targets import load_target

TIME_JOB = "harness.perf.jobs:time_job"
PAIRED_JOB = "harness.perf.jobs:paired_job"
CALL_JOB = "harness.perf.jobs:call_job"


def time_job(ctx: Any, case: Any, spec: str, repeats: int = REPEATS, clock: str = "cpu") -> list[float]:
    """Seconds per call of one routine, `repeats` calls after warm-up."""
    steady_allocator()
    call = benchmark_call(load_target(spec), case, ctx.rank, ctx.device, tp_group())
    timer = Timer(ctx.device, clock)
    for _ in range(WARMUP_CALLS):
        call()
    gc.collect()
    gc.disable()  # a collection inside one call of a pair and not the other is noise
    try:
        return [timer(call) for _ in range(repeats)]
    finally:
        gc.enable()


_prepared: dict[tuple[Any, str], Callable[[], None]] = {}


def call_job(ctx: Any, case: Any, spec: str) -> None:
    """One forward+backward, inputs kept from the previous call of the same case (the
    pytest-benchmark benchmarks time this from the driver)."""
    key = (case, spec)
    if key not in _prepared:
        steady_allocator()
        _prepared.clear()
        _prepared[key] = benchmark_call(load_target(spec), case, ctx.rank, ctx.device, tp_group())
    _prepared[key]()


def paired_job(ctx: Any, case: Any, old_spec: str, new_spec: str, pairs: int = PAIRS,
               seed: int = 0, clock: str = "cpu", inject: float = 0.0,
               block: int = BLOCK) -> list[tuple[float, float]]:
    """(old seconds, new seconds) per pair, the two run alternately in this process,
    each the fastest of `block` consecutive calls.

    The order inside each pair is drawn from `seed`, the same on every rank, so that all ranks run
    the same routine at the same time (their collectives must match). `inject` makes every new call
    that fraction slower (the calibration script's known slowdowns)."""
    steady_allocator()
    group = tp_group()
    old = benchmark_call(load_target(old_spec), case, ctx.rank, ctx.device, group)
    new = benchmark_call(load_target(new_spec), case, ctx.rank, ctx.device, group)
    timer = Timer(ctx.device, clock)
    if inject:
        if timer.cuda:
            raise ValueError("injected slowdowns are CPU-only: on CUDA the clock is the device's")
        new = with_overhead(new, inject, timer.now)
    for _ in range(WARMUP_CALLS):
        old()
        new()
    order = random.Random(seed)
    out = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(pairs):
            if order.random() < 0.5:
                t_old = min(timer(old) for _ in range(block))
                t_new = min(timer(new) for _ in range(block))
            else:
                t_new = min(timer(new) for _ in range(block))
                t_old = min(timer(old) for _ in range(block))
            out.append((t_old, t_new))
    finally:
        gc.enable()
    return out
