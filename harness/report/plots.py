"""The report's figures, as PNG data: URIs. Each draws one section of the view (report_view).

Figures are bare `matplotlib.figure.Figure`s: `savefig` renders them through Agg, with no pyplot
state and no GUI backend.
"""
from __future__ import annotations

import base64
import io
import math
from typing import Any

from matplotlib.figure import Figure

from harness.report import view as report_view

MARGIN_FLOOR = 1e-4  # error/tolerance below this is drawn at the floor of the log axis
OK, BAD = "#2e7d32", "#c62828"
GATED = ("slower", "faster", "unchanged")  # verdicts of the metrics judged against the decision line
METER_COLORS = ("#0d47a1", "#42a5f5", "#90caf9")  # retained, peak forward, peak backward


def png_uri(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def margin_figure(check: str, groups: dict[str, list[float]]) -> Figure:
    """Every comparison of one check, one row per configuration: how much of the tolerance the
    error used (1 = at the tolerance). The gap to the red line is the margin."""
    names = list(groups)
    fig = Figure(figsize=(5.6, 0.9 + 0.3 * len(names)))
    ax = fig.add_subplot()
    worst = max((max(v) for v in groups.values() if v), default=0.0)
    hi = max(2.0, worst * 2.0)
    for row, name in enumerate(names):
        values = [min(max(m, MARGIN_FLOOR), hi) for m in groups[name]]
        jitter = [((i * 0.618) % 1.0 - 0.5) * 0.5 for i in range(len(values))]  # deterministic spread
        colors = [BAD if m > 1 else OK for m in groups[name]]
        ax.scatter(values, [row + j for j in jitter], s=9, c=colors, alpha=0.55, linewidths=0)
        top = max(groups[name])
        ax.annotate(report_view.fmt_margin(top), (1.0, row), xycoords=("axes fraction", "data"),
                    xytext=(4, 0), textcoords="offset points", va="center", fontsize=7,
                    color=BAD if top > 1 else "#333")
    ax.axvline(1.0, color=BAD, linestyle="--", linewidth=1.2)
    ax.text(1.0, 0.01, "tolerance ", transform=ax.get_xaxis_transform(), color=BAD, fontsize=7,
            rotation=90, va="bottom", ha="right")
    ax.set_xscale("log")
    ax.set_xlim(MARGIN_FLOOR * 0.7, hi * 1.3)
    ticks = [10.0 ** k for k in range(round(math.log10(MARGIN_FLOOR)), math.ceil(math.log10(hi * 1.3)))]
    ax.set_xticks(ticks, [f"≤{MARGIN_FLOOR:g}" if t == MARGIN_FLOOR else f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.grid(axis="x", which="major", alpha=0.3)
    ax.set_xlabel("max |error| / tolerance allowed, per comparison (log)", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_title(f"{check}: worst {report_view.fmt_margin(worst)} of the tolerance", fontsize=10, loc="left")
    return fig


def _hbars(ax: Any, labels: list[str], series: list[tuple[str, list[float | None], str]]) -> None:
    height = 0.8 / len(series)
    for k, (label, values, color) in enumerate(series):
        ys = [i - 0.4 + height * (k + 0.5) for i in range(len(labels))]
        ax.barh(ys, [v or 0.0 for v in values], height=height, color=color, label=label)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.grid(axis="x", alpha=0.3)
    ax.tick_params(axis="x", labelsize=8)


def memory_figure(memory: dict[str, Any]) -> Figure:
    """Worst retained and peak bytes of each configuration, in the unit budgets are declared in,
    against the target's declared budget (one dashed line per figure it budgets)."""
    rows = memory["rows"]
    fig = Figure(figsize=(7.5, 1.4 + 0.5 * len(rows)))
    ax = fig.add_subplot()
    meters = memory["meters"]
    _hbars(ax, [r["config"] for r in rows],
           [(label, [r["values"].get(m) for r in rows], color)
            for (m, label), color in zip(meters, METER_COLORS, strict=False)])  # a colour per meter, up to three
    for (m, label), color in zip(meters, METER_COLORS, strict=False):
        limit = memory["budget"].get(m)
        if limit is not None:
            ax.axvline(limit, color=color, linestyle="--", linewidth=1.5, label=f"budget, {label}: {limit:g}")
    ax.set_xlabel(memory["unit"], fontsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.set_title("memory per configuration (worst case of each, per rank)", fontsize=10, loc="left")
    return fig


def baseline_figure(baseline: dict[str, Any]) -> Figure:
    """after/before per case, one panel per metric: 1 is unchanged, the dotted lines are the
    decision line of the gate (time with its confidence interval), red is a regression."""
    cases, metrics = baseline["cases"], baseline["metrics"]
    fig = Figure(figsize=(2.3 + 2.1 * len(metrics), 1.3 + 0.34 * len(cases)), layout="constrained")
    axes = fig.subplots(1, len(metrics), sharey=True, squeeze=False)[0]
    line = baseline["decision_line"]
    for ax, metric in zip(axes, metrics, strict=True):
        rows = {r["case"]: r for r in baseline["rows"] if r["metric"] == metric}
        for y, case in enumerate(cases):
            r = rows.get(case)
            if r is None or r["ratio"] is None:
                continue
            color = BAD if r["bad"] else OK
            ax.plot([1.0, r["ratio"]], [y, y], color=color, linewidth=2.5, solid_capstyle="butt")
            ax.plot([r["ratio"]], [y], "o", color=color, markersize=4)
            if r.get("ci"):
                ax.plot(r["ci"], [y, y], color="#333", linewidth=1)
        ax.axvline(1.0, color="#333", linewidth=1)
        if line and any(r["verdict"] in GATED for r in rows.values()):
            for x in (1 - line, 1 + line):
                ax.axvline(x, color="#999", linestyle=":", linewidth=1)
        ax.set_title(metric, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(labelsize=7)
        lo, hi = ax.get_xlim()
        ax.set_xlim(min(lo, 0.85), max(hi, 1.15))
    axes[0].set_yticks(range(len(cases)), cases, fontsize=7)
    axes[0].set_ylim(len(cases) - 0.5, -0.5)
    fig.supxlabel("after / before (1 = unchanged; right of 1 = slower or larger)", fontsize=8)
    return fig
