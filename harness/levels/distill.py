"""The distillation level: the full log-softmax shard, a top-k, log-probs gathered at global ids, and
per-token divergences over vocab-sharded student and teacher logits (docs/distill.md).

Named for its level, as `reference/distill.py` is its oracle's math, `checks/distill.py` its judge and
`targets/mutants/distill.py` its defects: a level keeps one module name across the layers."""
from __future__ import annotations

from harness.base.levels import Counts, Level, register
from harness.cases.benchmarks import DISTILL_PERF_CASES
from harness.cases.capabilities import fit_distill
from harness.cases.case import DistillCase
from harness.cases.strategies import distill_cases, distill_cover
from harness.checks import oracle
from harness.checks.distill import DISTILL_JUDGE
from harness.checks.memory import DistillMemory
from harness.checks.scripts.distill import DISTILL_SCRIPT
from harness.engine.calls import prepared_distill_call
from harness.engine.executor import run_distill
from harness.targets import DISTILL, Contract

LEVEL = register(Level(
    name="distill",
    case_class=DistillCase,
    contracts={
        "log_softmax": Contract(DISTILL["log_softmax"], ("logits", "tp_group"), dict(temperature=1.0, chunk_size=-1)),
        "topk": Contract(DISTILL["topk"], ("logits", "k", "tp_group"), dict(temperature=1.0, chunk_size=-1)),
        "gather": Contract(DISTILL["gather"], ("logits", "indices", "tp_group"),
                           dict(temperature=1.0, chunk_size=-1, renormalize=False)),
        "divergence": Contract(DISTILL["divergence"], ("student_logits", "tp_group"),
                               dict(teacher_logits=None, teacher_topk_log_probs=None, teacher_topk_indices=None,
                                    k=0, kind="forward_kl", beta=0.5, temperature=1.0, renormalize=True,
                                    chunk_size=-1),
                               keyword_only=True),
    },
    routine_key=lambda case: case.function,
    # A target without one of the four functions: cases of it are fitted to the others.
    missing_capability=lambda key: f"distill_{key}",
    fit=fit_distill,
    strategy=distill_cases,
    cover=distill_cover,  # every divergence x teacher x renormalization at a temperature, at any TP sizes
    run=run_distill,
    expected=oracle.distill_expected,
    judge=DISTILL_JUDGE,
    memory=DistillMemory(),
    script=DISTILL_SCRIPT,
    evidence=frozenset({"call", "empty-call", "no-grad-call", "oracle", "divergence", "memory", "memory-logits"}),
    benchmarks=DISTILL_PERF_CASES,
    benchmark=prepared_distill_call,
    counts=Counts(cases={"smoke": 6, "ci": 40, "thorough": 400}, dp={"ci": 4, "thorough": 60}),
))
