"""Checks that hold at every contract level: it runs, it returns, it runs on empty input, every
rank issues the same collectives, and the caller's inputs survive."""
from __future__ import annotations

import inspect
from typing import Any

import torch

from harness.checks import CALL, Evidence, Explain, bitwise_diff, check
from harness.checks.problems import ENTROPY, LOG_PROB
from harness.engine.observations import HANG_KINDS, HARNESS_STEP
from harness.meters.trace import fmt_event


def _errors(ev: Evidence) -> list[str]:
    return [f"{r.name} {r.error_kind}: {r.error}" for r in ev.failed_ranks]


def _crashed(ev: Evidence) -> list:
    """The ranks whose routine raised or died (not the harness's own step, not a rank left waiting)."""
    return [r for r in ev.failed_ranks if r.error_kind not in (*HANG_KINDS, HARNESS_STEP)]


def takes_cp(ev: Evidence) -> str:
    """What shows that the wrapper implements context parallelism: it asked parallel_state for its
    CP group, rank or size during the case, or its signature takes a CP argument; "" when nothing does."""
    if any(r.obs.cp_queried for r in ev.ranks):
        return "it asks megatron-core's parallel_state for its context-parallel group, rank or size"
    try:
        params = inspect.signature(ev.target.wrapper).parameters if ev.target.wrapper is not None else {}
    except (TypeError, ValueError):
        params = {}
    named = [p for p in params if p.startswith("cp_") or p.endswith("_cp") or "context_parallel" in p]
    return f"its signature takes {', '.join(named)}" if named else ""


def cp_hint(ev: Evidence) -> str:
    """After "wrong only at CP > 1": the capability line for a wrapper that shows no CP of its own
    (following it for one that implements CP would hide a defect of its CP path), or what shows it."""
    shown = takes_cp(ev)
    if shown:
        return (f"the wrapper implements context parallelism ({shown}), so this is a defect of its CP path "
                "(declaring `HARNESS_CAPABILITIES = {\"context_parallel\": False}` would only hide it)")
    return ("the wrapper never asked parallel_state for a context-parallel group, rank or size and takes no CP "
            "argument: a wrapper without context parallelism declares so in its module, "
            "`HARNESS_CAPABILITIES = {\"context_parallel\": False}`, and is then checked at CP 1 only")


def _at_cp1(case: Any, target: Any) -> dict[str, Any]:
    """At CP > 1 on a target that takes CP, the same case at CP 1 (what a crash's explanation runs)."""
    if getattr(case, "cp", 1) == 1 or not target.supports("context_parallel"):
        return {}
    return {"cp1": case.replace(cp=1, cp_layout="zigzag")}


def _only_at_cp(ev: Evidence, related: dict[str, Evidence]) -> str:
    """At CP > 1, whether the same case at CP 1 runs: then the routine fails only with context
    parallelism, and the finding says whether the wrapper shows CP of its own (`cp_hint`)."""
    if "cp1" not in related or _crashed(related["cp1"]):
        return ""
    return f"it raised only at CP > 1 (the same case at CP 1 runs): {cp_hint(ev)}"


@check("crash", evidence=CALL, applies=lambda c, t: c.T > 0, needs=None, explain=Explain(_at_cp1, _only_at_cp))
def crash(ev: Evidence) -> list[str]:
    """Every rank returns without raising or dying (a rank that never returns is `hang`'s, unless a
    peer raised or died first: a rank left waiting for that peer is named here)."""
    crashed = _crashed(ev)
    problems = [f"{r.name} {r.error_kind}: {r.error}" for r in crashed]
    if crashed:
        problems += [f"{r.name} left waiting for it ({r.error_kind})" for r in ev.ranks if r.error_kind in HANG_KINDS]
    return problems


@check("hang", evidence=CALL, needs=None)
def hang(ev: Evidence) -> list[str]:
    """Every rank returns: none is left blocked in a collective its peers never joined (found by
    evidence from the ranks' collective progress, long before the collective timeout), and none
    outruns the case deadline. A rank left waiting for a peer that raised or died, or whose harness
    step refused its output, is that peer's finding, not a hang."""
    if any(r.error and r.error_kind not in HANG_KINDS for r in ev.ranks):
        return []
    return [str(r.error) for r in ev.ranks if r.error_kind in HANG_KINDS]


@check("empty-input", evidence=("empty-call",), applies=lambda c, t: c.T == 0, needs=None)
def empty_input(ev: Evidence) -> list[str]:
    """T == 0 returns empty outputs without error, at every TP size."""
    problems = _errors(ev)
    for r in ev.ranks:
        for key, out in (("log_prob", r.obs.log_prob), ("entropy", r.obs.entropy)):
            if isinstance(out, torch.Tensor) and out.numel():
                problems.append(f"rank {r.rank}: {key} has {out.numel()} elements for T == 0")
    return problems


@check("collectives", evidence=CALL, needs=None, min_ranks=2)
def collectives(ev: Evidence) -> list[str]:
    """Every rank issues the same sequence of collectives (op, group size, shape, dtype) as its TP
    peers; at CP > 1 also the same collectives over groups of the CP size as its CP peers (the TP
    groups are disjoint, so their data-dependent collectives may differ; when the TP and CP sizes
    are equal the two cannot be told apart, and a CP peer's extra collective is `hang`'s finding).
    A rank that raised or died stopped issuing collectives where it failed: then only the sequences
    up to the shortest are compared, and the rest is `crash`'s."""
    stopped = bool(_crashed(ev))
    problems = [p for group in ev.groups() for p in _diverge(group, lambda r: r.trace, stopped=stopped)]
    cp = getattr(ev.case, "cp", 1)
    if cp > 1 and cp != ev.case.tp:
        peers: dict[tuple[int, int], list] = {}
        for r in ev.ranks:
            peers.setdefault((r.replica, r.rank), []).append(r)
        for ranks in peers.values():
            problems += _diverge(ranks, lambda r: [e for e in r.trace if e[1] == cp], f" over groups of {cp} ranks",
                                 stopped)
    return problems


def _diverge(ranks: list, trace, over: str = "", stopped: bool = False) -> list[str]:
    seqs = [trace(r) for r in ranks]
    if stopped:
        seqs = [s[:min(map(len, seqs))] for s in seqs]
    if all(s == seqs[0] for s in seqs):
        return []
    names = [r.name for r in ranks]
    counts = ", ".join(f"{n} issued {len(s)}" for n, s in zip(names, seqs, strict=True))
    first = next(i for i in range(max(map(len, seqs))) if len({tuple(s[i:i + 1]) for s in seqs}) > 1)
    detail = "; ".join(f"{n}: {fmt_event(s[first]) if first < len(s) else 'nothing'}"
                       for n, s in zip(names, seqs, strict=True))
    return [f"ranks diverge{over}: {counts}; first difference at collective #{first + 1}: {detail}"]


@check("inference-path", evidence=("no-grad-call",), applies=lambda c, t: c.T > 0 and not c.autograd,
       terms=True)
def inference_path(ev: Evidence) -> list[str]:
    """A call under torch.no_grad() or torch.inference_mode() (how trainers recompute old-policy
    and reference log-probs) returns what the training path returns on the same inputs, bit for
    bit, keep mask, temperature and top-p included."""
    problems = []
    for r in ev.ranks:
        if r.obs.training is None:
            continue
        lp, ent = r.obs.training
        problems += bitwise_diff(r.obs.log_prob, lp, f"{r.name} log_prob ({ev.case.context} vs training path)", LOG_PROB)
        problems += bitwise_diff(r.obs.entropy, ent, f"{r.name} entropy ({ev.case.context} vs training path)", ENTROPY)
    return problems


@check("input-integrity", evidence=CALL, needs="forward")
def input_integrity(ev: Evidence) -> list[str]:
    """Inputs keep their values and version counters through forward and backward."""
    return [f"{r.name}: {p}" for r in ev.ranks for p in r.obs.integrity]


@check("warning", evidence=CALL, needs=None)
def warning(ev: Evidence) -> list[str]:
    """The routine raises no warning that the user's own warnings filters make an error (`python -W
    error`, pytest's `filterwarnings = error`): under those filters its trainer would stop there.
    Such a warning is this finding, with its category, never a `crash`; a warning raised by the
    harness's own adapter code is never the routine's (`engine.warnings_seen`)."""
    return [f"{r.name}: the routine warns, {w}; your warnings filters make that an error"
            for r in ev.ranks for w in r.obs.warnings]
