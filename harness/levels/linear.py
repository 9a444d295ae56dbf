"""The fused-linear level: `calculate_linear_log_probs_and_entropy`, the LM head's matmul fused in
(docs/fused-linear.md).

Named for its level, as `reference/linear.py` is its oracle's math and `targets/mutants/linear.py` its
defects: a level keeps one module name across the layers."""
from __future__ import annotations

from harness.base.levels import Counts, Level, register
from harness.cases.benchmarks import LINEAR_PERF_CASES
from harness.cases.capabilities import fit
from harness.cases.case import LinearCase
from harness.cases.strategies import linear_cases
from harness.checks import oracle
from harness.checks.kernel import LINEAR_JUDGE
from harness.checks.memory import LinearMemory
from harness.checks.scripts.linear import LINEAR_SCRIPT
from harness.checks.terms import TOKEN_TERMS
from harness.engine.calls import prepared_linear_call
from harness.engine.executor import run_linear
from harness.targets import LINEAR, Contract

LEVEL = register(Level(
    name="linear",
    case_class=LinearCase,
    contracts={"linear": Contract(
        LINEAR, ("hidden", "weight", "tokens", "tp_group"),
        dict(with_entropy=False, chunk_size=-1, with_entropy_grad=True),
        optional={"with_entropy_grad": "metric_only_entropy"})},
    fit=fit,
    strategy=linear_cases,
    run=run_linear,
    expected=oracle.linear_expected,
    judge=LINEAR_JUDGE,
    terms=TOKEN_TERMS,
    memory=LinearMemory(),
    grad_shard_dim=0,  # the LM head's [V, H]: shards along the vocabulary, its first dimension
    # In one TP group on the training path: DP replicas and call contexts are the kernel level's axes.
    script=LINEAR_SCRIPT,
    evidence=frozenset({"call", "empty-call", "oracle", "memory", "memory-allowance", "metric-only-entropy",
                        "memory-logits", "linear-memory", "matmul-work"}),
    benchmarks=LINEAR_PERF_CASES,
    benchmark=prepared_linear_call,
    counts=Counts(cases={"smoke": 4, "ci": 30, "thorough": 300}),
))
