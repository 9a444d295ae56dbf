"""The benchmark cases of the performance gate and the pytest-benchmark suite: T x V_local x TP x
dtype x entropy settings, sized to a few milliseconds per call on one CPU thread (short calls are
cut less often by other jobs' time slices)."""
from __future__ import annotations

from harness.cases.case import KernelCase

PERF_CASES: tuple[KernelCase, ...] = (
    KernelCase(tp=1, T=128, v_local=2048, dtype="fp32", seed=11),
    KernelCase(tp=1, T=128, v_local=2048, dtype="bf16", with_entropy_grad=False, seed=12),
    KernelCase(tp=1, T=256, v_local=1024, dtype="fp32", with_entropy=False, chunk_size=64, seed=13),
    KernelCase(tp=2, T=128, v_local=1024, dtype="fp32", mask="random", seed=14),
    KernelCase(tp=2, T=128, v_local=1024, dtype="bf16", with_entropy=False, seed=15),
    KernelCase(tp=4, T=64, v_local=1024, dtype="fp32", chunk_size=32, seed=16),
)
