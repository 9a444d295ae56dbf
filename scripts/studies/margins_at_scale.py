"""How much of the float32 bound (docs/tolerances.md) correct routines use, and how far beyond it
defective ones go, at real vocabulary sizes: a few rows of V_local = 32768 per rank at TP 1, 2 and
4 (V up to 131072), in every logit regime and input dtype, on the worker pools like any case.

    python scripts/studies/margins_at_scale.py [--v-local 32768] [--rows 3] [--tp 1,2,4] [TARGET ...]

Prints one markdown row per target: the worst error/bound of each value and gradient check (a
correct routine must stay below 1; a mutant meant to fail should exceed it by far).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.cases.case import REGIMES, KernelCase  # noqa: E402
from harness.driver.pool import WorkerPool  # noqa: E402
from harness.driver.runner import Runner  # noqa: E402

CONTROLS = ("harness.targets.fused", "tests.controls.unshifted", "tests.controls.online", "tests.controls.gather",
            "tests.controls.twopass_pairwise", "tests.controls.inplace_grad", "tests.controls.autograd_collective")
MUTANTS = ("mutant:low-precision-math", "mutant:gradient-quantized-bf16")
CHECKS = ("values", "gradients", "tp-invariance", "chunk-invariance")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("targets", nargs="*", default=[*CONTROLS, *MUTANTS])
    ap.add_argument("--v-local", type=int, default=32768)
    ap.add_argument("--rows", type=int, default=3)
    ap.add_argument("--tp", default="1,2,4")
    ns = ap.parse_args()
    tps = [int(t) for t in ns.tp.split(",")]
    pools: dict[int, WorkerPool] = {}
    print(f"| target | {' | '.join(CHECKS)} | findings |\n|---|{'---|' * (len(CHECKS) + 1)}")
    try:
        for spec in ns.targets:
            runner = Runner(spec, collective_timeout_s=120, pools=pools)
            found = set()
            for tp in tps:
                for regime in REGIMES:
                    for dtype in ("fp32", "bf16"):
                        case = KernelCase(tp=tp, T=ns.rows, v_local=ns.v_local, dtype=dtype, regime=regime,
                                          chunk_size=2 if tp == 1 else -1, seed=7)
                        _, findings = runner.check(case, only=set(CHECKS))
                        found |= {f.check for f in findings}
            worst = []
            for name in CHECKS:
                margins = [m for (c, _), st in runner.verdicts.stats.items() if c == name for m in st.margins]
                worst.append(f"{max(margins):.3g}" if margins else "-")
            print(f"| `{spec}` | {' | '.join(worst)} | {', '.join(sorted(found)) or 'none'} |", flush=True)
    finally:
        for pool in pools.values():
            pool.close()


if __name__ == "__main__":
    main()
