"""The memory table of the README and docs/memory.md: retained and peak figures of the built-in
routine and the naive all-gather baseline on the same kernel cases (TP 1, in this process), in units
of T*V_local*4 bytes, with the ratio of the first to the second.

    python scripts/studies/memory_table.py [TARGET TARGET]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.cases.case import KernelCase  # noqa: E402
from harness.engine.executor import run_on_rank  # noqa: E402
from harness.meters.memory_meter import METERS, unit  # noqa: E402
from harness.targets import load_target  # noqa: E402


def table_cases() -> list[KernelCase]:
    base = KernelCase(tp=1, T=256, v_local=4096, seed=5)
    cases = []
    for dtype in ("fp32", "bf16"):
        for mask in ("none", "random"):
            for mode in ("log-prob", "metric-only", "entropy-grad"):
                for chunk in (-1, 32):
                    cases.append(base.replace(dtype=dtype, mask=mask, chunk_size=chunk,
                                              with_entropy=mode != "log-prob",
                                              with_entropy_grad=mode == "entropy-grad"))
    return cases


def table(targets: tuple[str, ...] = ("harness.targets.fused", "harness.targets.naive")) -> str:
    loaded = [load_target(t) for t in targets]
    names = [t.rsplit(".", 1)[-1] for t in targets]
    head = ["dtype", "mask", "entropy", "chunk"] + [f"{m} {n}" for m in METERS for n in names] + \
           [f"{m} ratio" for m in METERS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in table_cases():
        figs = []
        for target in loaded:
            r = run_on_rank(case, target, 0, torch.device("cpu"))
            if r.error:
                raise RuntimeError(f"{target.spec} failed on {case.spec()}: {r.error}")
            figs.append(r.obs.memory)
        u = unit(case.T, case.v_local)
        row = [case.dtype, case.mask, case.entropy_mode, str(case.chunk_size)]
        row += [f"{f[m] / u:.2f}" for m in METERS for f in figs]
        row += [f"{figs[0][m] / figs[1][m]:.2f}" if figs[1][m] else "-" for m in METERS]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(tuple(sys.argv[1:3])) if len(sys.argv) > 2 else table())
