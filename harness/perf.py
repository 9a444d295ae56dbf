"""Performance measurement of one forward+backward: the benchmark cases, the rank-side timing jobs
and the statistics of a paired comparison (docs/performance.md).

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
import gc
import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from cases.case import KernelCase
from harness.targets import Target, load_target

# The benchmark cases: T x V_local x TP x dtype x entropy settings, sized to a few milliseconds per
# call on one CPU thread (short calls are cut less often by other jobs' time slices).
PERF_CASES: tuple[KernelCase, ...] = (
    KernelCase(tp=1, T=128, v_local=2048, dtype="fp32", seed=11),
    KernelCase(tp=1, T=128, v_local=2048, dtype="bf16", with_entropy_grad=False, seed=12),
    KernelCase(tp=1, T=256, v_local=1024, dtype="fp32", with_entropy=False, chunk_size=64, seed=13),
    KernelCase(tp=2, T=128, v_local=1024, dtype="fp32", mask="random", seed=14),
    KernelCase(tp=2, T=128, v_local=1024, dtype="bf16", with_entropy=False, seed=15),
    KernelCase(tp=4, T=64, v_local=1024, dtype="fp32", chunk_size=32, seed=16),
)
WARMUP_CALLS = 3
PAIRS = 60  # pairs per round: with 30, one 10% slowdown in ten was missed here (docs/performance.md)
BLOCK = 3  # calls per routine and pair; the fastest counts (interference only ever adds time)
ROUNDS = 3  # at most this many rounds of PAIRS pairs, while the interval still straddles the line
REPEATS = 30  # calls per case when a single routine is timed (the baseline's own figure)
CONFIDENCE = 0.95
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def prepared_call(target: Target, case: KernelCase, rank: int, device: torch.device,
                  group: Any) -> Callable[[], None]:
    """One forward+backward of the target's kernel on this rank's shard, inputs built once."""
    full = case.inputs()
    sl = slice(rank * case.v_local, (rank + 1) * case.v_local)
    logits = full.logits[:, sl].contiguous().to(device).requires_grad_(case.requires_grad)
    tokens = full.tokens.to(device)
    keep = None if full.keep_mask is None else full.keep_mask[:, sl].contiguous().to(device)
    w1 = None if full.w_log_prob is None else full.w_log_prob.to(device)
    w2 = None if full.w_entropy is None else full.w_entropy.to(device)

    def call() -> None:
        logits.grad = None
        log_prob, entropy = target.kernel(logits, tokens, group, with_entropy=case.with_entropy,
                                          chunk_size=case.chunk_size, log_prob_keep_mask=keep,
                                          with_entropy_grad=case.with_entropy_grad)
        loss = _weighted(log_prob, w1) + _weighted(entropy, w2)
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
    return call


def _weighted(out: Any, w: torch.Tensor | None) -> Any:
    if w is None or not isinstance(out, torch.Tensor) or not out.requires_grad:
        return 0.0
    return (out.reshape(-1) * w.to(out.dtype)).sum()


# ---------------------------------------------------------------------------- rank-side jobs
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


def _group() -> Any:
    from harness.execute import tp_group

    return tp_group()


class _Timer:
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


def _with_overhead(call: Callable[[], None], fraction: float, clock: Callable[[], float]) -> Callable[[], None]:
    """Calibration only: the call, then busy work lasting `fraction` of the call's own duration on
    the measuring clock, so that every call is exactly `1 + fraction` times slower by construction
    (scripts/perf_calibration.py, the injected slowdowns)."""
    def slowed() -> None:
        t0 = clock()
        call()
        end = clock() + fraction * (clock() - t0)
        while clock() < end:
            pass
    return slowed


def time_job(ctx: Any, case: KernelCase, spec: str, repeats: int = REPEATS, clock: str = "cpu") -> list[float]:
    """Rank-side: seconds per call of one routine, `repeats` calls after warm-up."""
    steady_allocator()
    call = prepared_call(load_target(spec), case, ctx.rank, ctx.device, _group())
    timer = _Timer(ctx.device, clock)
    for _ in range(WARMUP_CALLS):
        call()
    gc.collect()
    gc.disable()  # a collection inside one call of a pair and not the other is noise
    try:
        return [timer(call) for _ in range(repeats)]
    finally:
        gc.enable()


_prepared: dict[tuple[KernelCase, str], Callable[[], None]] = {}


def call_job(ctx: Any, case: KernelCase, spec: str) -> None:
    """Rank-side: one forward+backward, inputs kept from the previous call of the same case (the
    pytest-benchmark benchmarks time this from the driver)."""
    key = (case, spec)
    if key not in _prepared:
        steady_allocator()
        _prepared.clear()
        _prepared[key] = prepared_call(load_target(spec), case, ctx.rank, ctx.device, _group())
    _prepared[key]()


def paired_job(ctx: Any, case: KernelCase, old_spec: str, new_spec: str, pairs: int = PAIRS,
               seed: int = 0, clock: str = "cpu", inject: float = 0.0,
               block: int = BLOCK) -> list[tuple[float, float]]:
    """Rank-side: (old seconds, new seconds) per pair, the two run alternately in this process,
    each the fastest of `block` consecutive calls.

    The order inside each pair is drawn from `seed`, the same on every rank, so that all ranks run
    the same routine at the same time (their collectives must match). `inject` makes every new call
    that fraction slower (the calibration script's known slowdowns)."""
    steady_allocator()
    group = _group()
    old = prepared_call(load_target(old_spec), case, ctx.rank, ctx.device, group)
    new = prepared_call(load_target(new_spec), case, ctx.rank, ctx.device, group)
    timer = _Timer(ctx.device, clock)
    if inject:
        if timer.cuda:
            raise ValueError("injected slowdowns are CPU-only: on CUDA the clock is the device's")
        new = _with_overhead(new, inject, timer.now)
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


def merge_ranks(per_rank: list[list[Any]]) -> list[Any]:
    """One value per call across ranks: the slowest rank's, since a step waits for it."""
    if len(per_rank) == 1:
        return list(per_rank[0])
    merged = []
    for values in zip(*per_rank):
        merged.append(tuple(map(max, zip(*values))) if isinstance(values[0], tuple) else max(values))
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
