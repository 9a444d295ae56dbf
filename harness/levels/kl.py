"""The KL-estimator level: per-token KL estimators (k1, k2, k3, a clamped log-ratio) between a
policy's and a reference's log-probs, masked and reduced as trainers reduce them (docs/kl.md).

Per token and not vocab-parallel: its cases run at TP 1 (`cases/kl.py`), its evidence is a call
(the distributed hygiene, `empty-input` at T = 0) and an oracle (`values`, `gradients`, `grad-flags`,
`shapes-dtypes`, `finite`). Named for its level across the layers: `cases/kl.py`, `reference/kl.py`,
`engine/kl.py`, `checks/kl.py`, `targets/fused_kl.py`, `targets/mutants/kl.py`."""
from __future__ import annotations

from harness.base.levels import Counts, Level, register
from harness.cases.kl import KLCase, fit_kl, kl_cases
from harness.checks.kl import KL_JUDGE, kl_expected
from harness.checks.scripts.kl import KL_SCRIPT
from harness.engine.kl import run
from harness.targets import Contract

LEVEL = register(Level(
    name="kl",
    case_class=KLCase,
    contracts={"kl": Contract("kl_estimate", ("log_probs", "ref_log_probs"),
                              dict(kind="k3", mask=None, reduction="none", clamp=None))},
    strategy=kl_cases,
    fit=fit_kl,  # a routine without the clamp, the sum or a per-token mask: the nearest case it takes
    run=run,
    expected=kl_expected,
    judge=KL_JUDGE,
    script=KL_SCRIPT,
    evidence=frozenset({"call", "empty-call", "oracle"}),
    # Per TP size asked for (all at TP 1): 3 x 10 cases at the default TP 1, 2, 4.
    counts=Counts(cases={"smoke": 4, "ci": 10, "thorough": 100}),
))
