"""The fused-linear distillation level: a distillation loss over a student's LM head and a teacher's
(hidden states and head, or logits), chunked over the tokens, reduced over the valid tokens of the
whole batch (docs/linear-distill.md).

One rank, no vocabulary shards: its cases run at TP 1 (`cases/linear_distill.py`), its evidence is a
call (the distributed hygiene) and an oracle (`values`, `gradients`, `grad-flags`, `shapes-dtypes`,
`finite`). Named for its level across the layers: `cases/linear_distill.py`,
`reference/linear_distill.py`, `engine/linear_distill.py`, `checks/linear_distill.py`,
`targets/fused_linear_distill.py`, `targets/mutants/linear_distill.py`."""
from __future__ import annotations

from harness.base.levels import Counts, Level, register
from harness.cases.linear_distill import (
    LinearDistillCase,
    fit_linear_distill,
    linear_distill_cases,
    linear_distill_cover,
)
from harness.checks.linear_distill import LINEAR_DISTILL_JUDGE, linear_distill_expected
from harness.checks.scripts.linear_distill import LINEAR_DISTILL_SCRIPT
from harness.engine.linear_distill import run
from harness.targets import Contract

LEVEL = register(Level(
    name="linear_distill",
    case_class=LinearDistillCase,
    contracts={"linear_distill": Contract(
        "linear_distill_loss", ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight", "labels"),
        dict(kind="jsd", beta=0.5, temperature=1.0, ignore_index=-100, hard_weight=0.0, soft_weight=1.0,
             chunk_size=-1))},
    strategy=linear_distill_cases,
    fit=fit_linear_distill,  # a routine without a divergence, a temperature, a hard loss, a teacher form or chunks
    run=run,
    expected=linear_distill_expected,
    judge=LINEAR_DISTILL_JUDGE,
    script=LINEAR_DISTILL_SCRIPT,
    evidence=frozenset({"call", "oracle"}),
    cover=linear_distill_cover,  # every divergence x teacher form, at a temperature, chunked unevenly
    # Per TP size asked for (all at TP 1): 3 x 10 cases at the default TP 1, 2, 4.
    counts=Counts(cases={"smoke": 3, "ci": 10, "thorough": 80}),
))
