"""The kernel level: `calculate_log_probs_and_entropy` over vocab-sharded logits (docs/contract.md).

Named for its level, as `reference/kernel.py` is its oracle's math, `checks/kernel.py` its judge and
`targets/mutants/kernel.py` its defects: a level keeps one module name across the layers."""
from __future__ import annotations

from harness.base.levels import Counts, Level, register
from harness.cases.benchmarks import PERF_CASES
from harness.cases.capabilities import fit
from harness.cases.case import KernelCase
from harness.cases.strategies import kernel_cases
from harness.checks import oracle
from harness.checks.kernel import KERNEL_JUDGE
from harness.checks.memory import LogitsMemory
from harness.checks.scripts.kernel import KERNEL_SCRIPT
from harness.checks.terms import TOKEN_TERMS
from harness.engine.calls import prepared_call
from harness.engine.executor import run_kernel
from harness.targets import KERNEL, Contract

LEVEL = register(Level(
    name="kernel",
    case_class=KernelCase,
    contracts={"kernel": Contract(
        KERNEL, ("logits", "tokens", "tp_group"),
        dict(with_entropy=False, chunk_size=-1, log_prob_keep_mask=None, with_entropy_grad=True),
        optional={"with_entropy_grad": "metric_only_entropy", "log_prob_keep_mask": "keep_mask"})},
    fit=fit,
    strategy=kernel_cases,
    run=run_kernel,
    expected=oracle.kernel_expected,
    judge=KERNEL_JUDGE,
    terms=TOKEN_TERMS,
    memory=LogitsMemory(),
    script=KERNEL_SCRIPT,
    evidence=frozenset({"call", "empty-call", "no-grad-call", "oracle", "repeatable", "batch-rows", "memory",
                        "memory-allowance", "metric-only-entropy", "memory-logits"}),
    benchmarks=PERF_CASES,
    benchmark=prepared_call,
    counts=Counts(cases={"smoke": 12, "ci": 150, "thorough": 1200}, dp={"ci": 24, "thorough": 300}),
))
