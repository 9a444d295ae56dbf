"""`check --save-baseline FILE` records, per benchmark case, time, instruction count, memory and
collectives; `check --baseline FILE` compares the target with it and adds one finding per
regression (docs/performance.md):

- `perf-instructions`: instructions of one single-rank forward+backward (callgrind), the primary CPU
  gate: deterministic, so compared with the file directly;
- `perf-collectives`: any collective op issued more often per call than in the baseline;
- `perf-memory`: any memory figure (retained, peak forward, peak backward) above the baseline's;
- `perf-time`: a slowdown whose confidence interval lies wholly beyond half the threshold.

Cases are matched by their case spec alone, never by module name: a baseline recorded from one
target compares against any other. Time is the exception that needs more than the file: timings
saved on a shared machine are noise, so time is only judged from a paired run of the baseline's
routine against the new one in one process. The reference routine is `--baseline-target` when
given, else the baseline's own target when its code is byte-for-byte the code recorded (a mutant
against the clean routine); otherwise the time row reports both figures and judges nothing.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import inspect
import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from harness.base import levels
from harness.base.errors import InstructionCountError, TargetError, UsageError
from harness.cases.capabilities import needs
from harness.checks.findings import Finding
from harness.driver.runner import Runner
from harness.engine.observations import RankResult
from harness.meters.memory_meter import figures_of, ledger_name
from harness.perf import callgrind, timing
from harness.perf.jobs import PAIRED_JOB, TIME_JOB
from harness.targets import Target, load_target

FORMAT = "harness-baseline/1"
DEFAULT_THRESHOLD = 0.10
MEMORY_ROWS = ("retained_bytes", "peak_bytes")  # the table's memory rows; findings cover every figure


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.1, got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction between 0 and 1, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("performance baseline (docs/performance.md)")
    g.add_argument("--save-baseline", metavar="FILE",
                   help="record time, instructions, memory and collectives of the benchmark cases")
    g.add_argument("--baseline", metavar="FILE", help="compare with a saved baseline; a regression is a finding")
    g.add_argument("--baseline-target", metavar="SPEC",
                   help="the routine the baseline was recorded from, importable here under any name: "
                        "timed alternately with --target (default: the baseline's own target, when its "
                        "code is unchanged); with --save-baseline alone, the routine the saved figures "
                        "are timed against, paired (`harness history --perf`)")
    g.add_argument("--slowdown-threshold", type=fraction, default=DEFAULT_THRESHOLD, metavar="FRACTION",
                   help="the slowdown the gate must catch (default 0.10); a case is flagged when its "
                        "slowdown is beyond half of this with 95%% confidence")


def finish(ns: argparse.Namespace, runner: Runner, result: dict[str, Any]) -> list[Finding]:
    say = (lambda msg: None) if ns.quiet else (lambda msg: print(f"[baseline] {msg}", file=sys.stderr, flush=True))
    findings: list[Finding] = []
    if ns.baseline:
        base = load(ns.baseline)
        comparison = compare(runner, base, ns.slowdown_threshold, ns.baseline_target, ns.baseline, say)
        result["baseline"] = comparison.to_json()
        print(comparison.markdown() + "\n")
        findings = comparison.findings
    if ns.save_baseline:
        cases = benchmark_cases(runner, ns.tp)
        reference = ns.baseline_target if not ns.baseline else None  # with --baseline it names that one's routine
        save(record(runner, cases, say, reference), ns.save_baseline)
        say(f"saved {len(cases)} cases to {ns.save_baseline}")
        result["baseline_saved"] = ns.save_baseline
    return findings


# ---------------------------------------------------------------------------- recording
def benchmark_cases(runner: Runner, tps: list[int]) -> list[Any]:
    """The benchmark cases of the target's levels (`Level.benchmarks`) at these TP sizes, fitted to
    what the target can take."""
    return list(dict.fromkeys(runner.fit(c) for lvl in runner.target.levels for c in levels.get(lvl).benchmarks
                              if c.tp in tps))


def code_fingerprint(target: Target) -> str:
    """sha256 of the source files behind the target's routines: their modules and, for a bound
    routine, every class it inherits from. Equal fingerprints: the same code, whatever it is called."""
    files = set()
    for fn in (fn for routines in target.routines.values() for fn in routines.values()):
        owners = type(fn.__self__).__mro__ if hasattr(fn, "__self__") else ()
        for obj in (fn, *owners):
            try:
                files.add(inspect.getsourcefile(obj))
            except TypeError:  # builtins (object) have no source
                pass
    digest = hashlib.sha256()
    for source in sorted(Path(f).read_bytes() for f in files if f):  # by content: paths do not matter
        digest.update(source)
    return digest.hexdigest()


ENTROPY_LABELS = {"log-prob only": "logprob", "metric-only entropy": "ent-metric",
                  "differentiable entropy": "ent-grad"}


def label(case: Any) -> str:
    """Short name of a benchmark case for tables: TP, T x V_local (x H, the fused-linear level's hidden
    size), dtype, entropy or the distillation function, chunk, mask."""
    hidden = f"xH{case.H}" if hasattr(case, "H") else ""
    parts = [f"tp{case.tp}", f"T{case.T}xV{case.v_local}{hidden}", case.dtype]
    function = getattr(case, "function", None)  # a distillation case: its function and divergence
    parts += [function, *([case.kind, f"teacher-{case.teacher}"] if function == "divergence" else [])] if function \
        else [ENTROPY_LABELS[case.entropy_mode]]
    if case.chunk_size > 0:
        parts.append(f"chunk{case.chunk_size}")
    if getattr(case, "mask", "none") != "none":
        parts.append(f"mask-{case.mask}")
    return " ".join(parts)


def collective_counts(ranks: list[RankResult]) -> dict[str, int]:
    """Collectives per call by op, the most any rank issued (ranks should agree; a check says if not)."""
    out: dict[str, int] = {}
    for r in ranks:
        mine: dict[str, int] = {}
        for op, *_ in r.trace:
            mine[op] = mine.get(op, 0) + 1
        for op, n in mine.items():
            out[op] = max(out.get(op, 0), n)
    return dict(sorted(out.items()))


def memory_figures(ranks: list[RankResult]) -> dict[str, int | float]:
    """Memory figures (bytes), the largest over ranks, plus `peak_bytes` = the larger peak."""
    out: dict[str, int | float] = {}
    for r in ranks:
        if not r.obs.memory:
            continue
        for k, v in figures_of(r.obs.memory).items():
            if isinstance(v, (int, float)):
                out[k] = max(out.get(k, v), v)
    peaks = [out[k] for k in ("peak_forward_bytes", "peak_backward_bytes") if k in out]
    if peaks:
        out["peak_bytes"] = max(peaks)
    return dict(sorted(out.items()))


def pool_values(runner: Runner, case: Any, job: str, *args: Any) -> list[Any]:
    """A timing job on every rank of the case's pool; merged per call over ranks."""
    replies = runner.pool(case.tp).run(job, *args, deadline_s=600)
    errors = [r.error for r in replies if isinstance(r, RankResult)]
    if errors:
        raise RuntimeError(f"{job} failed on {case.spec()}: {errors[0]}")
    return timing.merge_ranks(replies)


def _static(runner: Runner, case: Any) -> dict[str, Any]:
    """The deterministic figures of one case from the runner's (cached) execution."""
    ev = runner.run(case)
    if ev.failed_ranks:
        return {"error": ev.failed_ranks[0].error}
    return {"collectives": collective_counts(ev.ranks), "memory": memory_figures(ev.ranks)}


def _clock(device: str) -> str:
    return "cuda-events" if device == "cuda" else "cpu-process-time"


def record(runner: Runner, cases: list[Any], say: Callable[[str], None] = lambda m: None,
           reference: str | None = None, threshold: float = DEFAULT_THRESHOLD) -> dict[str, Any]:
    """The baseline of the runner's target: one entry per case, in order. With `reference` (a
    routine importable here under another name, `--baseline-target`), each case's time is also
    paired against it (`paired`: the median ratio target/reference, its interval and the verdict
    at `threshold`), or why it could not be (`reference_error`)."""
    target = runner.target
    if not cases:
        raise TargetError(f"{target.spec} has no benchmark cases: none of its levels ({', '.join(target.levels)}) has any")
    why_unpaired = None
    if reference is not None:
        try:
            load_target(reference)
        except TargetError as e:
            why_unpaired = f"the reference routine cannot be imported: {e}"
    entries = []
    for case in cases:
        say(f"recording {label(case)}")
        entry = {"case": case.spec(), "label": label(case), **_static(runner, case)}
        if "error" not in entry:
            times = sorted(pool_values(runner, case, TIME_JOB, case, target.spec, timing.REPEATS))
            entry["time_s"] = times[len(times) // 2]
            if reference is not None:
                entry["paired"] = _paired(runner, case, reference, threshold) if why_unpaired is None \
                    else {"against": reference, "error": why_unpaired[-500:]}
        entries.append(entry)
    counted = _instructions(target.spec, [c for c in cases if c.tp == 1], runner.device, say)
    for entry in entries:
        got = counted.get("cases", {}).get(entry["case"])
        if got:
            entry["instructions"] = got["instructions"]
            entry["instruction_repeats"] = got["repeats"]
    return {"format": FORMAT, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "target": target.spec, "code": code_fingerprint(target), "device": runner.device,
            "memory_ledger": ledger_name(), "clock": _clock(runner.device), "environment": counted.get("environment"),
            **({"instructions_skipped": counted["skipped"]} if "skipped" in counted else {}),
            **({"reference": reference, "threshold": threshold} if reference is not None else {}), "cases": entries}


def _paired(runner: Runner, case: Any, reference: str, threshold: float) -> dict[str, Any]:
    """The target timed against `reference` on the case's pool, alternately (`timing.sequential_ratio`)."""
    try:
        r, rounds = timing.sequential_ratio(lambda seed: pool_values(runner, case, PAIRED_JOB, case, reference,
                                                                     runner.target.spec, timing.PAIRS, seed), threshold)
    except RuntimeError as e:  # the reference routine failed where the target did not
        return {"against": reference, "error": str(e)[-500:]}
    return {"against": reference, "ratio": r.median, "ci": [r.low, r.high], "old_s": r.old_s, "new_s": r.new_s,
            "pairs": r.pairs, "rounds": rounds, "verdict": r.verdict(threshold)}


def _instructions(spec: str, cases: list[Any], device: str, say: Callable[[str], None]) -> dict[str, Any]:
    if not cases or device != "cpu":
        return {}
    why = callgrind.available()
    if why:
        say(f"instruction counts skipped: {why}")
        return {"skipped": why}
    say(f"counting instructions of {len(cases)} single-rank cases under callgrind (about 30 s)")
    try:
        return callgrind.count(spec, cases)
    except InstructionCountError as e:  # the other figures still stand
        say(f"instruction counts failed: {e}")
        return {"skipped": str(e)[-800:]}  # its end: what failed


def save(data: dict[str, Any], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def load(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"cannot read baseline {path}: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UsageError(f"{path} is not a harness baseline ({FORMAT})")
    return data


# ---------------------------------------------------------------------------- comparing
@dataclass
class Comparison:
    file: str
    target: str
    baseline_target: str
    reference: str | None  # the routine timed against the target, or None (time not judged)
    threshold: float
    clock: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def row(self, case: Any, metric: str, before: Any, after: Any, verdict: str, bad: bool = False,
            ci: tuple[float, float] | None = None) -> None:
        ratio = after / before if isinstance(before, (int, float)) and isinstance(after, (int, float)) and before else None
        self.rows.append({"case": label(case), "spec": case.spec(), "metric": metric, "before": before,
                          "after": after, "ratio": ratio, "ci": list(ci) if ci else None, "verdict": verdict,
                          "bad": bad})

    def flag(self, check: str, case: Any, message: str) -> None:
        repro = (f"python -m harness check --target {shlex.quote(self.target)} --tp {case.tp} --profile smoke "
                 f"--baseline {shlex.quote(self.file)}")
        if self.reference and self.reference != self.baseline_target:
            repro += f" --baseline-target {shlex.quote(self.reference)}"
        self.findings.append(Finding(check, case.level, case.spec(), message, repro))

    @property
    def note(self) -> str:
        head = (f"{self.target} against the baseline of {self.baseline_target} ({Path(self.file).name}); "
                f"flagged: instructions or time beyond {self.threshold / 2:.0%} "
                f"(half the {self.threshold:.0%} threshold), any extra collective, any memory increase.")
        return " ".join([head, *self.notes])

    def markdown(self) -> str:
        lines = [f"**Performance** — {self.note}", "",
                 "| case | metric | before | after | ratio | verdict |", "|---|---|---:|---:|---:|---|"]
        for r in self.rows:
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
            if r["ci"]:
                ratio += f" [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]"
            verdict = f"**{r['verdict']}**" if r["bad"] else r["verdict"]
            lines.append(f"| {r['case']} | {r['metric']} | {_fmt(r['before'])} | {_fmt(r['after'])} | {ratio} | {verdict} |")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "target": self.target, "baseline_target": self.baseline_target,
                "reference": self.reference, "threshold": self.threshold, "decision_line": self.threshold / 2,
                "clock": self.clock, "pairs": timing.PAIRS, "rounds": timing.ROUNDS, "confidence": timing.CONFIDENCE, "note": self.note,
                "rows": self.rows, "findings": [f.to_json() for f in self.findings], "markdown": self.markdown()}


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def reference_routine(base: dict[str, Any], explicit: str | None) -> tuple[str | None, str]:
    """The routine to time the target against, and why (or why there is none)."""
    if explicit:
        load_target(explicit)  # a bad spec is a usage error now, not a crash mid-run
        return explicit, f"time: paired against {explicit} (--baseline-target)."
    try:
        recorded = load_target(base["target"])
    except TargetError:
        return None, f"time: not judged, the baseline's target {base['target']} cannot be imported here."
    if code_fingerprint(recorded) != base.get("code"):
        return None, (f"time: not judged, the code of {base['target']} changed since the baseline; "
                      f"pass the old routine as --baseline-target to time the two alternately.")
    return base["target"], f"time: paired against {base['target']} (code unchanged since the baseline)."


def compare(runner: Runner, base: dict[str, Any], threshold: float = DEFAULT_THRESHOLD,
            baseline_target: str | None = None, file: str = "baseline.json",
            say: Callable[[str], None] = lambda m: None) -> Comparison:
    reference, why = reference_routine(base, baseline_target)
    clock = _clock(runner.device)
    cmp = Comparison(str(file), runner.target.spec, base["target"], reference, threshold, clock, notes=[why])
    if not runner.target.levels:
        cmp.notes.append("not compared: the target has no routine.")
        return cmp
    if base.get("clock") != clock:
        cmp.notes.append(f"the baseline was timed with {base.get('clock')}, this run with {clock}.")
    ledger, base_ledger = ledger_name(), base.get("memory_ledger")
    memory_comparable = base_ledger in (None, ledger)  # a baseline that names none: compared as before
    if not memory_comparable:
        cmp.notes.append(f"memory: not compared, the baseline was measured by the {base_ledger} ledger and this run "
                         f"by the {ledger} one (their figures may differ; HARNESS_LEDGER={base_ledger} compares).")
    entries = [(levels.parse(e["case"]), e) for e in base["cases"]
               if levels.parse(e["case"]).level in runner.target.levels]  # a level the target has
    counted = _instructions(runner.target.spec, [c for c, e in entries if "instructions" in e], runner.device, say)
    same_env = counted.get("environment") == base.get("environment")
    if "skipped" in counted:
        cmp.notes.append(f"instructions: not counted, {counted['skipped']}.")
    if counted.get("cases") and not same_env:
        cmp.notes.append(f"instructions: not judged, recorded under {base.get('environment')}, "
                         f"counted under {counted.get('environment')}.")
    for case, old in entries:
        say(f"comparing {label(case)}")
        if runner.fit(case) != case:
            cmp.notes.append(f"{label(case)}: not compared, the target does not take "
                             f"{', '.join(sorted(needs(case) - needs(runner.fit(case))))} (HARNESS_CAPABILITIES).")
            continue
        if "error" in old:
            cmp.notes.append(f"{label(case)}: the baseline's target failed on it ({old['error'][:200]}).")
            continue
        new = _static(runner, case)
        if "error" in new:
            cmp.notes.append(f"{label(case)}: the target failed on it ({new['error'][:200]}); the checks report it.")
            continue
        try:
            _compare_time(cmp, runner, case, old, reference, threshold)
        except RuntimeError as e:  # the reference routine failed where the target did not
            cmp.notes.append(f"{label(case)}: time not compared ({str(e)[:200]}).")
        if "instructions" in old and case.spec() in counted.get("cases", {}):
            _compare_instructions(cmp, case, old["instructions"], counted["cases"][case.spec()]["instructions"],
                                  threshold, judged=same_env)
        _compare_collectives(cmp, case, old["collectives"], new["collectives"])
        if memory_comparable:
            _compare_memory(cmp, case, old["memory"], new["memory"])
    return cmp


def _compare_time(cmp: Comparison, runner: Runner, case: Any, old: dict[str, Any],
                  reference: str | None, threshold: float) -> None:
    if reference is None:
        times = sorted(pool_values(runner, case, TIME_JOB, case, runner.target.spec, timing.REPEATS))
        cmp.row(case, "time (ms)", old.get("time_s", 0) * 1e3, times[len(times) // 2] * 1e3, "not judged (unpaired)")
        return
    r, _ = timing.sequential_ratio(lambda seed: pool_values(runner, case, PAIRED_JOB, case, reference,
                                                           runner.target.spec, timing.PAIRS, seed), threshold)
    verdict = r.verdict(threshold)
    cmp.row(case, "time (ms)", r.old_s * 1e3, r.new_s * 1e3, verdict, verdict == "slower", (r.low, r.high))
    cmp.rows[-1]["ratio"] = r.median  # the median of the paired ratios, not the ratio of the medians
    if verdict == "slower":
        cmp.flag("perf-time", case,
                 f"{r.median:.3f}x the time of {reference} ({timing.CONFIDENCE:.0%} CI {r.low:.3f}-{r.high:.3f}, "
                 f"{r.pairs} paired calls, {cmp.clock}): {r.median - 1:.0%} slower, beyond the "
                 f"{threshold / 2:.0%} decision line of the {threshold:.0%} threshold")


def _compare_instructions(cmp: Comparison, case: Any, before: int, after: int, threshold: float,
                          judged: bool) -> None:
    ratio = after / before
    verdict = ("slower" if ratio > 1 + threshold / 2 else "faster" if ratio < 1 - threshold / 2 else "unchanged") \
        if judged else "not judged (environment differs)"
    cmp.row(case, "instructions", before, after, verdict, verdict == "slower")
    if verdict == "slower":
        cmp.flag("perf-instructions", case,
                 f"{after:,} instructions per single-rank forward+backward, {before:,} in the baseline: "
                 f"{ratio:.3f}x, beyond the {threshold / 2:.0%} decision line (counts repeat exactly)")


def _compare_collectives(cmp: Comparison, case: Any, before: dict[str, int], after: dict[str, int]) -> None:
    more = {op: (before.get(op, 0), n) for op, n in after.items() if n > before.get(op, 0)}
    total_before, total_after = sum(before.values()), sum(after.values())
    verdict = "more" if more else "fewer" if total_after < total_before else "same"
    cmp.row(case, "collectives", total_before, total_after, verdict, bool(more))
    if more:
        cmp.flag("perf-collectives", case, "more collectives per call than the baseline: " +
                 ", ".join(f"{op} {a} -> {b}" for op, (a, b) in more.items()))


def _compare_memory(cmp: Comparison, case: Any, before: dict[str, int], after: dict[str, int]) -> None:
    grown = {k: (v, after[k]) for k, v in before.items() if k != "peak_bytes" and after.get(k, v) > v}
    for metric in MEMORY_ROWS:
        if metric in before and metric in after:
            up = after[metric] > before[metric]
            cmp.row(case, metric.replace("_", " "), before[metric], after[metric],
                    "larger" if up else "smaller" if after[metric] < before[metric] else "same", up)
    if grown:
        cmp.flag("perf-memory", case, "more memory than the baseline: " +
                 ", ".join(f"{k} {a:,} -> {b:,}" for k, (a, b) in grown.items()))
