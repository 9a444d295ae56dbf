"""Reports (`check --report`) and trends (`trend DIR`): rendered from result JSON, self-contained."""
from __future__ import annotations

import argparse
import base64
import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.cases.case import KernelCase, WrapperCase
from harness.cli import main
from harness.commands import trend
from harness.driver.runner import Runner
from harness.perf.gate import FORMAT as BASELINE_FORMAT
from harness.report import render as report
from harness.report import view as report_view
from harness.report.result import result_json

PNG = b"\x89PNG\r\n\x1a\n"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def synthetic_result() -> dict:
    """A result as `check --json` writes it: two findings, margins in three configurations."""
    findings = [
        {"check": "values", "level": "kernel", "case": "kernel:tp=4,T=3,v_local=5,dtype=bf16,seed=7",
         "message": "rank 0 entropy (atol=1e-06, rtol=0): Tensor-likes are not close!\n\nMismatched elements: 2 / 3",
         "repro": "python -m harness repro --target mutant:x 'kernel:tp=4,T=3,v_local=5,dtype=bf16,seed=7'",
         "ranks": [], "shrunk": True},
        {"check": "collectives", "level": "wrapper", "case": "wrapper:tp=2,v_local=5,total_lengths=(6,4)",
         "message": "rank 1 issued 3 collectives, rank 0 issued 2",
         "repro": "python -m harness repro --target mutant:x 'wrapper:tp=2,v_local=5,total_lengths=(6,4)'",
         "ranks": [1], "shrunk": False},
    ]
    checks = {
        "values": {"kernel": {"applied": 30, "failed": 4, "max_margin": 40.0, "margins": [0.1, 0.2, 40.0],
                              "margins_by_group": {"kernel-tp1-fp32-unmasked": [0.1, 0.2],
                                                   "kernel-tp4-bf16-masked": [40.0]}}},
        "collectives": {"kernel": {"applied": 30, "failed": 0, "max_margin": None, "margins": [],
                                   "margins_by_group": {}},
                        "wrapper": {"applied": 9, "failed": 1, "max_margin": None, "margins": [],
                                    "margins_by_group": {}}},
        "wrapper-extraction": {"wrapper": {"applied": 9, "failed": 0, "max_margin": 0.6, "margins": [0.6, 1e-9],
                                           "margins_by_group": {"wrapper-tp2-plain": [0.6, 1e-9]}}},
    }
    return {"target": "mutant:x", "levels": ["kernel", "wrapper"], "capabilities": {"keep_mask": False},
            "cases_run": 39, "elapsed_s": 3.2, "case_seconds": 1.1, "cases_per_s": 35.4,
            "findings": findings, "checks": checks, "profile": "smoke", "seed": 0, "tp": [1, 2, 4]}


def with_memory_and_baseline(result: dict) -> dict:
    """The sections other features add: memory per configuration and a baseline comparison."""
    case = "kernel:tp=1,T=8,v_local=16,dtype=bf16,seed=3"
    worst = lambda v: {"value": v, "case": case}  # noqa: E731
    result["memory_by_config"] = {"budget": {"retained": 1.0, "peak_backward": 4.0}, "configs": {
        "kernel bf16, metric-only entropy": {"cases": 5, "worst": {"retained": worst(2.5), "peak_forward": worst(3.0)}},
        "wrapper, log-prob only": {"cases": 2, "worst": {"retained": worst(0.2), "peak_backward": worst(2.0)}}}}
    row = lambda case, metric, before, after, verdict, bad, ci=None: {  # noqa: E731
        "case": case, "spec": "kernel:...", "metric": metric, "before": before, "after": after,
        "ratio": after / before if before else None, "ci": ci, "verdict": verdict, "bad": bad}
    a, b = "tp1 T128xV2048 fp32 ent-grad", "tp2 T128xV1024 bf16 logprob"
    result["baseline"] = {"note": "mutant:x against the baseline of harness.targets.fused", "decision_line": 0.05,
                          "rows": [row(a, "time (ms)", 3.5, 4.2, "slower", True, [1.15, 1.25]),
                                   row(a, "instructions", 1000, 1010, "unchanged", False),
                                   row(b, "time (ms)", 2.0, 1.9, "unchanged", False),
                                   row(b, "collectives", 0, 0, "same", False)]}
    return result


def image_uris(page: str) -> list[str]:
    return re.findall(r'<img src="([^"]+)"', page)


def assert_self_contained(page: str) -> None:
    assert not re.search(r"https?://", page), "the page must not reach the network"
    assert "<script" not in page and "<link" not in page
    uris = image_uris(page)
    assert uris
    for uri in uris:
        assert uri.startswith("data:image/png;base64,")
        assert base64.b64decode(uri.split(",", 1)[1]).startswith(PNG)


def test_html_is_self_contained_and_shows_each_finding():
    result = synthetic_result()
    page = report.render_html(result)
    assert_self_contained(page)
    assert len(image_uris(page)) == 2  # one error/tolerance plot per check that compared values
    text = html.unescape(page)
    for f in result["findings"]:
        for key in ("check", "case", "repro"):
            assert f[key] in text
    assert "not measured in this run" in page  # memory
    assert "no baseline was given" in page
    assert "kernel-tp4-bf16-masked" in page  # where the worst error was


def test_memory_and_baseline_sections_when_measured():
    result = with_memory_and_baseline(synthetic_result())
    page = report.render_html(result)
    assert_self_contained(page)
    assert len(image_uris(page)) == 4  # two margin plots, memory, baseline
    assert "not measured" not in page
    text = html.unescape(page)
    assert "Budget declared by the target (HARNESS_MEMORY_BUDGET): retained 1, peak_backward 4." in text
    assert "mutant:x against the baseline of harness.targets.fused" in text
    md = report.render_markdown(result)
    assert "| **kernel bf16, metric-only entropy** | 5 | 2.5 | 3 | - |" in md  # over its retained budget
    assert "| tp1 T128xV2048 fp32 ent-grad | 1.2 **slower** | 1.01 unchanged | - |" in md
    assert "| tp2 T128xV1024 bf16 logprob | 0.95 unchanged | - | - same |" in md


def test_markdown_shows_summary_findings_and_repros():
    result = synthetic_result()
    md = report.render_markdown(result)
    assert md.startswith("### harness check `mutant:x`: ❌ 2 finding(s) in 2 check(s)")
    assert "| ❌ values | 30 / 4 | - | **40** | kernel-tp4-bf16-masked |" in md
    assert "| ✅ wrapper-extraction | - | 9 / 0 | **0.6** | wrapper-tp2-plain |" in md
    for f in result["findings"]:
        assert f"**`{f['check']}`**" in md and f"`{f['case']}`" in md and f["repro"] in md
    assert "Not measured" in md


def test_findings_read_like_the_console_shrunk_first_and_one_start():
    result = synthetic_result()
    corpus = {**result["findings"][0], "case": "kernel:tp=4,T=40,v_local=5,dtype=bf16,seed=9", "shrunk": False}
    second = {**result["findings"][0], "check": "gradients", "level": "kernel"}
    result["findings"] = [result["findings"][1], corpus, *result["findings"], second]  # the corpus's first
    md = report.render_markdown(result)
    heads = [line for line in md.splitlines() if line.startswith("**`")]
    assert heads[0].startswith("**`values`** (kernel, shrunk, start from this one)")
    assert heads[1].startswith("**`values`** (kernel)") and heads[2].startswith("**`gradients`** (kernel, shrunk)")
    assert heads[3].startswith("**`collectives`** (wrapper, failed ranks 1)")
    assert md.count("start from this one") == 1
    page = html.unescape(report.render_html(result))
    assert page.count("start from this one") == 1
    assert page.index("start from this one") < page.index(corpus["case"]) < page.index("failed ranks 1")


def test_results_without_margins_by_group_still_render():
    result = synthetic_result()
    for per_level in result["checks"].values():
        for stats in per_level.values():
            del stats["margins_by_group"]
    assert "all cases" in report.render_html(result)


def test_report_option_takes_html_or_md_only():
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    assert parser.parse_args(["--report", "a.html", "--report", "b.md"]).report == [Path("a.html"), Path("b.md")]
    with pytest.raises(SystemExit):
        parser.parse_args(["--report", "a.pdf"])


@pytest.mark.distributed
def test_report_of_a_real_run_with_findings(harness_pools, tmp_path):
    """A defective routine, a few real cases: the page carries the summary, each finding with its
    check, case and repro, and the error/tolerance plots; the markdown carries the same findings."""
    runner = Runner("mutant:low-precision-math", pools=harness_pools)
    findings = []
    for case in (KernelCase(tp=1, T=4, v_local=8, dtype="bf16", seed=1),
                 KernelCase(tp=2, T=3, v_local=5, seed=2),
                 WrapperCase(tp=2, v_local=5, total_lengths=(6, 4), response_lengths=(3, 2), seed=3)):
        findings += runner.check(case)[1]
    assert findings
    result = result_json(runner, findings, 1.0, {"profile": "test", "seed": 0, "tp": [1, 2]})
    json.dumps(result)  # the JSON is the source: it must serialise as it is
    ns = argparse.Namespace(report=[tmp_path / "r.html", tmp_path / "r.md"])
    assert report.finish(ns, runner, result) == []
    page = (tmp_path / "r.html").read_text()
    md = (tmp_path / "r.md").read_text()
    assert_self_contained(page)
    text = html.unescape(page)
    assert "kernel-tp1-bf16-unmasked" in text and "kernel-tp2-fp32-unmasked" in text
    assert set(result["memory_by_config"]["configs"]) >= {"kernel bf16, differentiable entropy",
                                                          "kernel fp32, differentiable entropy"}
    assert len(image_uris(page)) == len(report_view.margins(result)) + 1  # and the memory plot
    for f in findings:
        assert f.check in text and f.case in text and f.repro in text
        assert f.case in md and f.repro in md


def benchmark_json(when: str, commit: str, medians: dict[str, float], extra: dict[str, dict]) -> dict:
    """The layout pytest-benchmark writes with --benchmark-json (fields the trend does not read left out)."""
    return {"machine_info": {}, "commit_info": {"id": commit}, "datetime": when, "version": "5.1.0",
            "benchmarks": [{"group": None, "name": name, "fullname": f"tests/test_perf.py::{name}",
                            "params": None, "param": None, "extra_info": extra.get(name, {}),
                            "stats": {"min": t * 0.9, "median": t, "mean": t, "rounds": 5}}
                           for name, t in medians.items()]}


def test_trend_plots_two_saved_runs(tmp_path, capsys):
    runs = tmp_path / "runs"
    (runs / "machine").mkdir(parents=True)
    (runs / "machine" / "0002_new.json").write_text(json.dumps(benchmark_json(
        "2025-02-01T10:00:00", "b" * 40, {"kernel-tp2": 0.012, "wrapper-tp2": 0.031},
        {"kernel-tp2": {"instructions": 2.1e8, "peak_bytes": 3 << 20}})))
    (runs / "machine" / "0001_old.json").write_text(json.dumps(benchmark_json(
        "2025-01-01T10:00:00", "a" * 40, {"kernel-tp2": 0.010, "wrapper-tp2": 0.030},
        {"kernel-tp2": {"instructions": 2.0e8, "peak_bytes": 2 << 20}})))
    (runs / "notes.json").write_text('{"unrelated": true}')
    loaded = trend.load_runs(runs)
    assert [r.label for r in loaded] == ["2025-01-01 10:00:00\naaaaaaaa", "2025-02-01 10:00:00\nbbbbbbbb"]
    assert loaded[1].values == {"time": {"kernel-tp2": 0.012, "wrapper-tp2": 0.031},
                                "instructions": {"kernel-tp2": 2.1e8}, "memory": {"kernel-tp2": 3 << 20}}
    out = tmp_path / "trend.png"
    assert main(["trend", str(runs), "-o", str(out)]) == 0
    assert out.read_bytes().startswith(PNG)
    assert "2 runs" in capsys.readouterr().out


def test_trend_reads_saved_baselines(tmp_path):
    for n, (when, ms) in enumerate([("2025-03-01T09:00:00+00:00", 3.1), ("2025-03-02T09:00:00+00:00", 3.4)]):
        (tmp_path / f"base{n}.json").write_text(json.dumps({
            "format": BASELINE_FORMAT, "created": when, "target": "harness.targets.fused", "cases": [
                {"case": "kernel:tp=1,T=128,v_local=2048,seed=11", "label": "tp1 T128xV2048 fp32 ent-grad",
                 "time_s": ms / 1e3, "instructions": 16_967_815 + n, "memory": {"peak_bytes": 7_605_892}},
                {"case": "kernel:tp=2,T=128,v_local=1024,seed=14", "error": "RuntimeError: boom"}]}))
    runs = trend.load_runs(tmp_path)
    assert [r.label for r in runs] == ["2025-03-01 09:00:00\nharness.targets.fused",
                                       "2025-03-02 09:00:00\nharness.targets.fused"]
    assert runs[1].values == {"time": {"tp1 T128xV2048 fp32 ent-grad": 3.4e-3},
                              "instructions": {"tp1 T128xV2048 fp32 ent-grad": 16_967_816.0},
                              "memory": {"tp1 T128xV2048 fp32 ent-grad": 7_605_892.0}}
    out = tmp_path / "t.png"
    assert main(["trend", str(tmp_path), "-o", str(out)]) == 0
    assert out.read_bytes().startswith(PNG)


def test_trend_without_saved_runs_is_an_error(tmp_path, capsys):
    assert main(["trend", str(tmp_path), "-o", str(tmp_path / "t.png")]) == 2
    assert "no saved baseline or benchmark JSON" in capsys.readouterr().err


def screenshot(page: Path, png: Path, height: int = 2400) -> None:
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                    f"--screenshot={png}", f"--window-size=1200,{height}", page.resolve().as_uri()],
                   check=True, capture_output=True, timeout=120)


@pytest.mark.slow
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed")
def test_headless_chromium_renders_the_report(tmp_path):
    page = tmp_path / "report.html"
    report.write_report(page, synthetic_result())
    png = tmp_path / "shot.png"
    screenshot(page, png)
    data = png.read_bytes()
    assert data.startswith(PNG)
    assert len(data) > 50_000  # a blank page compresses to a few KB; text and plots do not
