"""`python -m harness trend DIR`: time, instruction count, memory and collectives across saved runs,
one plot per metric, one line per case.

DIR holds saved harness baselines, pytest-benchmark JSON files (`--benchmark-json`,
`--benchmark-autosave`'s `.benchmarks/`) or the `history.json` of `harness history --perf` (each
commit with figures is a run, in the history's order), searched recursively; runs are ordered by the
time they record (file name when they record none).
"""
from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.base import extras
from harness.base.errors import UsageError
from harness.perf.gate import FORMAT as BASELINE_FORMAT

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# metric -> (axis label, scale from the stored unit). Stored units: seconds, instructions, bytes.
METRICS = {
    "time": ("median time (ms)", 1e3),
    "instructions": ("instructions (millions)", 1e-6),
    "memory": ("peak memory (MiB)", 1 / 2**20),
    "retained": ("retained memory (MiB)", 1 / 2**20),
    "collectives": ("collectives per call", 1.0),
}

WIDE_RANGE = 30  # largest/smallest value of a panel beyond which it is drawn on a log axis


@dataclass
class Run:
    label: str
    when: str  # ISO time when the file records one, else "" (then the file name orders runs)
    path: Path
    values: dict[str, dict[str, float]] = field(default_factory=dict)  # metric -> case -> value
    order: int = 0  # its place among the runs of one file (a history's commits)
    covers: Path | None = None  # the saved baseline it stands for (a history's commit: its check's record)

    def add(self, metric: str, case: str, value: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            self.values.setdefault(metric, {})[case] = float(value)


def from_pytest_benchmark(path: Path, data: dict[str, Any]) -> Run:
    when = data.get("datetime") or ""
    commit = (data.get("commit_info") or {}).get("id") or ""
    label = when[:19].replace("T", " ") or path.stem
    if re.fullmatch(r"[0-9a-f]{7,40}", commit):
        label += f"\n{commit[:8]}"
    run = Run(label, when, path)
    for bench in data["benchmarks"]:
        case = bench.get("name") or bench["fullname"]
        run.add("time", case, (bench.get("stats") or {}).get("median"))
        extra = bench.get("extra_info") or {}
        run.add("instructions", case, extra.get("instructions"))
        run.add("memory", case, extra.get("peak_bytes"))  # the names harness baselines use
        run.add("retained", case, extra.get("retained_bytes"))
        run.add("collectives", case, extra.get("collective_count"))
    return run


def from_baseline(path: Path, data: dict[str, Any]) -> Run:
    """A file of `check --save-baseline` (harness.baseline): time, instructions, memory per case."""
    when = data.get("created") or ""
    run = Run(f"{when[:19].replace('T', ' ') or path.stem}\n{data.get('target', '')}".strip(), when, path)
    for entry in data["cases"]:
        case = entry.get("label") or entry["case"]
        run.add("time", case, entry.get("time_s"))
        run.add("instructions", case, entry.get("instructions"))
        run.add("memory", case, (entry.get("memory") or {}).get("peak_bytes"))
        run.add("retained", case, (entry.get("memory") or {}).get("retained_bytes"))
        if "collectives" in entry:
            run.add("collectives", case, sum(entry["collectives"].values()))
    return run


def from_history(path: Path, data: dict[str, Any]) -> list[Run]:
    """The commits of a `harness history --perf` with figures, one run each, in the history's order
    (`perf.figures`: the figures its check recorded; a commit with the same files as an earlier one
    has that one's)."""
    runs = []
    for i, row in enumerate(data["rows"]):
        figures = (row.get("perf") or {}).get("figures") or {}
        if not figures:
            continue
        run = Run(f"{row['short'][:8]}\n{row.get('date', '')}".strip(), "", path, order=i,
                  covers=path.parent / f"{row['short']}.baseline.json")
        for case, fig in figures.items():
            run.add("time", case, fig.get("time_s"))
            run.add("instructions", case, fig.get("instructions"))
            run.add("memory", case, fig.get("peak_bytes"))
            run.add("retained", case, fig.get("retained_bytes"))
            run.add("collectives", case, fig.get("collectives"))
        runs.append(run)
    return runs


def load_run(path: Path) -> list[Run]:
    """The saved runs of one file: one, or a history's commits; none for a JSON file of another kind."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return []
    if not isinstance(data, dict):
        return []
    if data.get("format") == BASELINE_FORMAT:
        return [from_baseline(path, data)]
    if isinstance(data.get("benchmarks"), list):
        return [from_pytest_benchmark(path, data)]
    if isinstance(data.get("rows"), list) and data.get("perf"):
        return from_history(path, data)
    return []


def load_runs(directory: Path) -> list[Run]:
    runs = [r for p in sorted(directory.rglob("*.json")) for r in load_run(p) if r.values]
    covered = {r.covers for r in runs}  # a history's commits, once: not again as the records beside it
    return sorted((r for r in runs if r.path not in covered), key=lambda r: (r.when, str(r.path), r.order))


def trend_figure(runs: list[Run]) -> Figure:
    # Figure.savefig renders PNG through Agg: no pyplot, no GUI
    Figure = extras.require("matplotlib.figure", "report", "harness trend").Figure  # noqa: N806
    cases = sorted({c for r in runs for per_case in r.values.values() for c in per_case})
    fig = Figure(figsize=(max(7.0, 1.1 * len(runs) + 3), 2.6 * len(METRICS) + 0.3 * (len(cases) // 2 + 1)),
                 layout="constrained")
    axes = fig.subplots(len(METRICS), 1, sharex=True)
    xs = range(len(runs))
    for ax, (metric, (label, scale)) in zip(axes, METRICS.items(), strict=True):
        ax.set_ylabel(label, fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        measured = [v for r in runs for v in r.values.get(metric, {}).values() if v > 0]
        if not measured:
            ax.text(0.5, 0.5, "not recorded in these runs", transform=ax.transAxes, ha="center",
                    va="center", color="#888")
            ax.set_yticks([])
            continue
        for i, case in enumerate(cases):
            ys = [r.values.get(metric, {}).get(case) for r in runs]
            ys = [y * scale if y is not None else float("nan") for y in ys]  # NaN: a gap, not a zero
            ax.plot(xs, ys, marker="o", markersize=4, linewidth=1.4, label=case, color=f"C{i % 10}",
                    linestyle=("-", "--", ":")[i // 10 % 3])
        if max(measured) > WIDE_RANGE * min(measured):
            ax.set_yscale("log")  # cases of very different sizes: a linear axis flattens the small ones
        else:
            ax.set_ylim(bottom=0)
    crowded = len(runs) > 6
    axes[-1].set_xticks(list(xs), [r.label for r in runs], rotation=30 if crowded else 0,
                        ha="right" if crowded else "center")
    axes[0].set_title(f"{len(runs)} saved runs, one line per case", fontsize=10, loc="left")
    handles = max((ax.get_legend_handles_labels() for ax in axes), key=lambda hl: len(hl[1]))
    fig.legend(*handles, loc="outside lower center", fontsize=7, ncols=2, frameon=False)
    return fig


def cmd_trend(ns: argparse.Namespace, _cfg: Any = None) -> int:
    extras.require("matplotlib", "report", "harness trend")
    directory = Path(ns.directory)
    if not directory.is_dir():
        raise UsageError(f"{directory} is not a directory")
    runs = load_runs(directory)
    if not runs:
        raise UsageError(f"no saved baseline or benchmark JSON with figures under {directory}")
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    trend_figure(runs).savefig(out, dpi=110)
    metrics = sorted({m for r in runs for m in r.values})
    span = " .. ".join(r.label.replace("\n", " ") for r in (runs[0], runs[-1]))
    print(f"{out}: {len(runs)} runs ({span}); {', '.join(metrics)}")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("trend", help="plot time, instructions, memory and collectives across saved runs "
                                            "or a history's commits",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", metavar="DIR", help="folder of saved baselines, pytest-benchmark JSON or a "
                                                    "`history --perf` output")
    p.add_argument("-o", "--out", default="trend.png", metavar="FILE.png", help="where to write the plot")
    p.set_defaults(func=cmd_trend)
