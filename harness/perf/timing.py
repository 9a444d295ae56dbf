"""Clocks and statistics of the performance gate (docs/performance.md); the rank-side jobs that use
them are `perf.jobs`, the benchmark cases `cases.benchmarks`.

Timing is paired: the old and the new routine run alternately in one worker process, in a seeded
random order inside each pair, so drift of the machine (other jobs, frequency, caches) hits both
alike, and the verdict rests on the per-pair ratios new/old: their median, with a distribution-free
confidence interval. Each side of a pair is the fastest of a few consecutive calls, since
interference only ever adds time. On CPU the clock is the process's CPU time
(`time.process_time`): on a shared box it leaves out the slices the OS gives to other jobs, which
wall-clock time counts as ours; and freed memory stays in the process (`steady_allocator`). On
CUDA the clock is a pair of CUDA events around the call.
"""
from __future__ import annotations

import ctypes
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

WARMUP_CALLS = 3
PAIRS = 60  # pairs per round: with 30, one 10% slowdown in ten was missed here (docs/performance.md)
BLOCK = 3  # calls per routine and pair; the fastest counts (interference only ever adds time)
ROUNDS = 3  # at most this many rounds of PAIRS pairs, while the interval still straddles the line
REPEATS = 30  # calls per case when a single routine is timed (the baseline's own figure)
CONFIDENCE = 0.95
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


# ---------------------------------------------------------------------------- clocks
def steady_allocator() -> None:
    """Keep freed memory in the process (glibc: no trimming, no per-allocation mmap), as PyTorch's
    CUDA caching allocator does. Otherwise every call page-faults its buffers afresh, and the
    kernel's page zeroing, whose cost on a shared VM varies with the neighbours, becomes the
    noisiest part of the time (docs/performance.md: intervals 7 to 19 times narrower)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: the allocator stays as it is
        return
    libc.mallopt(M_TRIM_THRESHOLD, -1)
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)  # glibc's largest


class Timer:
    """Seconds taken by `fn()`: CUDA events on a GPU, process CPU time or wall clock on CPU."""

    def __init__(self, device: torch.device, clock: str):
        self.cuda = device.type == "cuda"
        self.now = time.process_time if clock == "cpu" else time.perf_counter
        self.synced = dist.is_initialized() and dist.get_world_size() > 1

    def __call__(self, fn: Callable[[], None]) -> float:
        if self.synced:
            dist.barrier()  # every rank starts together: a call's time is not the wait for a late peer
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = self.now()
        fn()
        return self.now() - t0


def with_overhead(call: Callable[[], None], fraction: float, clock: Callable[[], float]) -> Callable[[], None]:
    """Calibration only: the call, then busy work lasting `fraction` of the call's own duration on
    the measuring clock, so that every call is exactly `1 + fraction` times slower by construction
    (scripts/studies/perf_calibration.py, the injected slowdowns)."""
    def slowed() -> None:
        t0 = clock()
        call()
        end = clock() + fraction * (clock() - t0)
        while clock() < end:
            pass
    return slowed


def merge_ranks(per_rank: list[list[Any]]) -> list[Any]:
    """One value per call across ranks: the slowest rank's, since a step waits for it."""
    if len(per_rank) == 1:
        return list(per_rank[0])
    merged = []
    for values in zip(*per_rank, strict=True):
        merged.append(tuple(map(max, zip(*values, strict=True))) if isinstance(values[0], tuple) else max(values))
    return merged


# ---------------------------------------------------------------------------- statistics
@dataclass(frozen=True)
class Ratio:
    """new/old: the median of the per-pair ratios and its confidence interval."""
    median: float
    low: float
    high: float
    pairs: int
    old_s: float  # median seconds per call, old routine
    new_s: float

    def open(self, threshold: float) -> bool:
        """The interval straddles the slowdown line: more pairs could still decide either way."""
        return self.low <= 1 + threshold / 2 < self.high

    def verdict(self, threshold: float) -> str:
        """'slower' when the whole interval lies beyond half the threshold, 'faster' likewise."""
        line = threshold / 2
        if self.low > 1 + line:
            return "slower"
        if self.high < 1 - line:
            return "faster"
        return "unchanged"


def median_ci_ranks(n: int, confidence: float = CONFIDENCE) -> tuple[int, int]:
    """0-based ranks (lo, hi) of the order statistics bounding the median with `confidence`
    (the binomial, distribution-free interval: no assumption on the shape of the noise)."""
    alpha = (1 - confidence) / 2
    k, cdf = 0, 0.0
    while k < n and cdf + math.comb(n, k) / 2**n <= alpha:
        cdf += math.comb(n, k) / 2**n
        k += 1
    k = max(k, 1)  # too few pairs for the level asked: the extremes are the interval
    return k - 1, n - k


def sequential_ratio(run: Callable[[int], list[tuple[float, float]]], threshold: float,
                     rounds: int = ROUNDS) -> tuple[Ratio, int]:
    """(ratio, rounds used): `run(seed)` gives one round of pairs; rounds are added while the
    interval straddles the slowdown line. A clear case costs one round; a slowdown near the line,
    or a noisy machine, gets up to `rounds` times the pairs before it is judged."""
    pairs: list[tuple[float, float]] = []
    for seed in range(rounds):
        pairs += run(seed)
        ratio = paired_ratio(pairs)
        if not ratio.open(threshold):
            return ratio, seed + 1
    return ratio, rounds


def paired_ratio(pairs: list[tuple[float, float]], confidence: float = CONFIDENCE) -> Ratio:
    ratios = sorted(new / old for old, new in pairs if old > 0)
    if not ratios:
        raise ValueError("no usable pair (every old time was zero)")
    lo, hi = median_ci_ranks(len(ratios), confidence)
    return Ratio(statistics.median(ratios), ratios[lo], ratios[hi], len(ratios),
                 statistics.median(o for o, _ in pairs), statistics.median(n for _, n in pairs))
