"""`check --report FILE.html|FILE.md`: the run's result JSON rendered for people.

HTML: one self-contained page (images embedded as data: URIs, no network) with the summary, the
findings and their repros, per check the error measured against the tolerance allowed, memory per
configuration against the budget, and performance before/after a baseline. Markdown: the same as
text tables, for a PR comment (no images: PR comments do not show data: URIs).

The result JSON is the one source of both: `finish` first adds to it the one figure the checks do
not (memory per configuration, summarized from the runner's cases), and the reports are rendered
from the dict alone, so a saved `--json` file renders the same report (`render_html(json.load(f))`).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.base import extras
from harness.cases.case import Case
from harness.checks import Evidence
from harness.checks.findings import Finding
from harness.checks.memory import budget_use
from harness.driver.runner import Runner
from harness.meters import memory_meter
from harness.report import view as report_view

if TYPE_CHECKING:
    import jinja2  # the report extra's

SUFFIXES = (".html", ".md")


def report_path(text: str) -> Path:
    path = Path(text)
    if path.suffix not in SUFFIXES:
        raise argparse.ArgumentTypeError(f"--report writes {' or '.join(SUFFIXES)} files, got {text!r}")
    try:  # said before the run, not after it
        extras.require("jinja2", "report", "--report")
        if path.suffix == ".html":
            extras.require("matplotlib", "report", "an HTML --report (its plots)")
    except extras.MissingExtra as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--report", type=report_path, action="append", default=[], metavar="FILE",
                        help="write a report: FILE.html (self-contained page with plots) or FILE.md "
                             "(for a PR comment); repeatable")


def finish(ns: argparse.Namespace, runner: Runner, result: dict[str, Any]) -> list[Finding]:
    """Adds the memory figures per configuration to the result (so `--json` carries what the
    report shows), then writes each report asked for."""
    result["memory_by_config"] = memory_by_config(runner.executed(), runner.target.memory_budget)
    for path in ns.report:
        write_report(path, result)
    return []


def memory_config(case: Case) -> str:
    """Configurations as memory differs: per-rank bytes in units of T*V_local*4 do not depend on
    the TP size, they do on the input dtype and on what the entropy costs."""
    # A level whose contract takes float32 logits (half precision opt-in) names the dtype only when it differs.
    dtype = f" {case.dtype}" if case.dtype != "fp32" or not case.half_precision_capability else ""
    return f"{case.level}{dtype}, {case.entropy_mode}"


def memory_by_config(executed: list[Evidence], budget: dict[str, float]) -> dict[str, Any] | None:
    """The worst of each memory figure per configuration, over the cases run and their ranks, on the
    scale of HARNESS_MEMORY_BUDGET (`checks.memory.budget_use`): a figure above its budget is one
    that fails `memory-budget`. None when no case was measured."""
    configs: dict[str, dict[str, Any]] = {}
    for ev in executed:
        case = ev.case
        figures = [r.obs.memory for r in ev.ranks]
        # Only a level whose memory is weighed in multiples of its logits' T*V_local*4 is on this table's
        # scale (`on_logits_scale`): not the linear level's (memory-linear-retained's: no [T, V_local] at
        # all), nor the distillation level's (no budget; its memory check is memory-no-vocab-gather).
        # A level without memory rules (`Level.memory` None: the KL-estimator level's O(T) tensors) is not either.
        if case.T == 0 or ev.level.memory is None or not ev.level.memory.on_logits_scale or ev.failed_ranks \
                or not all(figures):
            continue
        row = configs.setdefault(memory_config(case), {"cases": 0, "worst": {}, "dtype": case.dtype})
        row["cases"] += 1
        for meter in memory_meter.METERS:
            got = [f[meter] for f in figures if f.get(meter) is not None]
            if not got:
                continue
            value = max(0.0, budget_use(case, max(got), meter))
            if value >= row["worst"].get(meter, {"value": -1.0})["value"]:
                row["worst"][meter] = {"value": round(value, 4), "case": case.spec()}
    if not configs:
        return None
    return {"budget": dict(budget), "configs": {name: configs[name] for name in sorted(configs)}}


def write_report(path: Path, result: dict[str, Any]) -> None:
    text = render_html(result) if path.suffix == ".html" else render_markdown(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def environment(autoescape: bool) -> "jinja2.Environment":
    jinja2 = extras.require("jinja2", "report", "a report")
    env = jinja2.Environment(loader=jinja2.PackageLoader("harness.report", "templates"), autoescape=autoescape,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True)
    env.filters["md_cell"] = lambda s: str(s).replace("|", "\\|").replace("\n", " ")
    env.filters["num"] = report_view.fmt_number
    env.filters["margin"] = report_view.fmt_margin
    return env


def render_html(result: dict[str, Any]) -> str:
    extras.require("matplotlib", "report", "an HTML report (its plots)")
    from harness.report.plots import baseline_figure, margin_figure, memory_figure, png_uri

    view = report_view.view(result)
    compared = view["baseline"] and view["baseline"]["rows"]
    figures = {
        "margins": {name: png_uri(margin_figure(name, groups)) for name, groups in view["margins"].items()},
        "memory": png_uri(memory_figure(view["memory"])) if view["memory"] else None,
        "baseline": png_uri(baseline_figure(view["baseline"])) if compared else None,
    }
    return environment(autoescape=True).get_template("report.html.j2").render(v=view, fig=figures)


def render_markdown(result: dict[str, Any]) -> str:
    return environment(autoescape=False).get_template("report.md.j2").render(v=report_view.view(result))
