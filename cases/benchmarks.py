"""The benchmark cases of the performance gate and the pytest-benchmark suite: T x V_local x TP x
dtype x entropy settings, sized to a few milliseconds per call on one CPU thread (short calls are
cut less often by other jobs' time slices)."""
from __future__ import annotations

from harness.cases.case import DistillCase, KernelCase, LinearCase

PERF_CASES: tuple[KernelCase, ...] = (
    KernelCase(tp=1, T=128, v_local=2048, dtype="fp32", seed=11),
    KernelCase(tp=1, T=128, v_local=2048, dtype="bf16", with_entropy_grad=False, seed=12),
    KernelCase(tp=1, T=256, v_local=1024, dtype="fp32", with_entropy=False, chunk_size=64, seed=13),
    KernelCase(tp=2, T=128, v_local=1024, dtype="fp32", mask="random", seed=14),
    KernelCase(tp=2, T=128, v_local=1024, dtype="bf16", with_entropy=False, seed=15),
    KernelCase(tp=4, T=64, v_local=1024, dtype="fp32", chunk_size=32, seed=16),
)

# The fused-linear level's (LM head [V, H] fused in) and the distillation level's, for the same gate
# (`Level.benchmarks`): the kernel's sizes, a hidden size that keeps a call at a few milliseconds.
LINEAR_PERF_CASES: tuple[LinearCase, ...] = (
    LinearCase(tp=1, T=128, H=64, v_local=1024, dtype="fp32", seed=21),
    LinearCase(tp=1, T=128, H=64, v_local=1024, dtype="bf16", with_entropy=False, chunk_size=32, seed=22),
    LinearCase(tp=2, T=128, H=64, v_local=512, dtype="fp32", seed=23),
)
DISTILL_PERF_CASES: tuple[DistillCase, ...] = (
    DistillCase(tp=1, T=128, v_local=2048, function="divergence", kind="forward_kl", teacher="full", seed=31),
    DistillCase(tp=1, T=128, v_local=2048, function="log_softmax", dtype="bf16", seed=32),
    DistillCase(tp=2, T=128, v_local=1024, function="divergence", kind="jsd", teacher="topk", k=8, chunk_size=64,
                seed=33),
)
