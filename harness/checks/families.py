"""A family: one defect's findings. It is a check and what the check is about: the output term
(the log-prob or the entropy, `checks.terms`) and, where it decides the verdict, the call context
(a second call, an accumulated microbatch, a frozen input, a CP layout: `context_of`). A context
decides a verdict when the same case in the plain context (`plain`) passes that check; a check that
applies only in that context (`frozen-input-work`) is about it by definition.

Families are what `--known` and `HARNESS_USE` entries may name (`term`), what the result JSON
counts (`families`), and the columns of `harness peers` and `harness history`: a fix of one term's
gradient shows as that family's FIXED HERE while the other term's gradient still fails.
Each family also counts its cases per configuration (`config_key`): which configurations fail
(`where`: "at TP > 1") and, between two commits, which start or stop failing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.cases.case import Case


def context_of(case: Case) -> str:
    """The call context a family may be about: "" on the plain training path, else the case's
    context, frozen input and CP layout ("two_calls", "frozen=weight", "cp=allgather"), read off the
    fields a case has (a level without a frozen input or CP has no such context)."""
    parts = [case.context] if case.context != "train" else []
    if getattr(case, "frozen", "none") != "none":
        parts.append(f"frozen={case.frozen}")  # pyright: ignore[reportAttributeAccessIssue]
    if getattr(case, "cp", 1) > 1:
        parts.append(f"cp={case.cp_layout}")  # pyright: ignore[reportAttributeAccessIssue]
    return ",".join(parts)


_PLAIN_PATH = {"context": "train", "frozen": "none", "cp": 1, "cp_layout": "zigzag"}


def plain(case: Case) -> Case:
    """The same case on the plain training path: one call, every input trainable, no CP (of the
    fields its level has)."""
    return case.replace(**{k: v for k, v in _PLAIN_PATH.items() if k in case.__dataclass_fields__})


def family_key(check: str, term: str = "", context: str = "") -> str:
    """How a family is named: `gradients [log-prob]`, `crash [two_calls]`, `values`."""
    about = ", ".join(p for p in (term, context) if p)
    return f"{check} [{about}]" if about else check


def family_label(check: str, term: str = "", context: str = "") -> str:
    """The family in words: "log-prob gradients", "entropy values", "crash (two_calls)"."""
    name = check.removeprefix("wrapper-") if term and check in ("wrapper-gradients", "wrapper-entropy") else check
    text = f"{term} {name}" if term and name in ("gradients", "values") else \
        f"{name} of the {term}" if term else name
    return text + (f" ({context})" if context else "")


# The configuration of a case, as a family's counts are kept: what decides whether a defect shows,
# not the data (no seed, no sizes but TP > 1 and T = 0).
CONFIG_FIELDS = ("tp", "dtype", "regime", "chunks", "mask", "layout", "context", "entropy", "frozen", "cp")


def _chunks(case: Case) -> str:
    if case.chunk_size <= 0:
        return "none"
    return "several" if case.T > case.chunk_size else "one"


def config_of(case: Case) -> dict[str, str]:
    masked = getattr(case, "mask", "none") != "none" or getattr(case, "top_p", "none") != "none"
    return {
        "tp": ">1" if case.tp > 1 else "1",
        "dtype": getattr(case, "dtype", "fp32"),
        "regime": getattr(case, "regime", "normal"),
        "chunks": _chunks(case),
        "mask": "masked" if masked else "unmasked",
        "layout": getattr(case, "hidden_view", getattr(case, "layout", "contiguous")),
        "context": case.context,
        "entropy": "empty" if case.T == 0 else case.entropy_mode,
        "frozen": getattr(case, "frozen", "none"),
        "cp": getattr(case, "cp_layout", "none") if getattr(case, "cp", 1) > 1 else "none",
    }


def config_key(case: Case) -> str:
    """`config_of` as one string: `level:tp=>1,dtype=fp32,...`."""
    return f"{case.level}:" + ",".join(f"{k}={v}" for k, v in config_of(case).items())


def parse_config(key: str) -> dict[str, str]:
    level, _, body = key.partition(":")
    out = {"level": level}
    for part in body.split(","):
        k, _, v = part.partition("=")
        out[k] = v
    return out


_PHRASES = {
    "tp": {">1": "at TP > 1", "1": "at TP 1"},
    "dtype": {"fp32": "in float32", "bf16": "in bfloat16", "fp16": "in float16"},
    "regime": {"neginf": "with -inf logits", "huge": "with huge logits", "peaked": "with peaked logits",
               "ties": "with tied logits", "normal": "with ordinary logits", "wide": "with wide logits",
               "drift": "with drifting hidden states"},
    "chunks": {"several": "with two or more chunks", "one": "in one chunk", "none": "unchunked"},
    "mask": {"masked": "with a keep mask or top-p", "unmasked": "without a mask"},
    "entropy": {"differentiable entropy": "with a differentiable entropy", "metric-only entropy":
                "with a metric-only entropy", "log-prob only": "without the entropy", "empty": "at T = 0"},
    "layout": {v: f"with {v} logits" for v in ("transposed", "row_strided", "col_strided", "offset", "nonleaf")}
    | {v: f"with {v} hidden states" for v in ("shifted", "seq_first")},
    "context": {v: f"in {v}" for v in ("no_grad", "inference_mode", "accumulate", "two_calls", "two_inputs")},
    "frozen": {"weight": "with the weight frozen", "hidden": "with the hidden states frozen"},
    "cp": {"zigzag": "at CP > 1 (zigzag)", "allgather": "at CP > 1 (all-gather)"},
}


WHERE_DIMS = ("tp", "dtype", "regime", "chunks", "entropy", "mask")  # what `where` may say, in this order
WHERE_SAID = 3  # at most this many of them


def where(configs: dict[str, list[int]]) -> str:
    """What a family's failing configurations share that its passing ones do not ("at TP > 1",
    "in bfloat16, with -inf logits"); "" when nothing sets them apart, or one configuration alone
    fails (it shares everything with itself). `configs`: config key -> [cases checked, cases failed]."""
    failing = [parse_config(k) for k, (_, failed) in configs.items() if failed]
    if len(failing) < 2:
        return ""
    passing = [parse_config(k) for k, (applied, failed) in configs.items() if applied > failed]
    said = []
    for dim in WHERE_DIMS:
        values = {c.get(dim) for c in failing}
        if len(values) != 1:
            continue
        value = values.pop()
        if value is None or not any(c.get(dim) != value for c in passing):
            continue  # shared by the passing configurations too: says nothing
        said.append(_PHRASES[dim].get(value, f"{dim} {value}"))
    return ", ".join(said[:WHERE_SAID])


def changed(before: dict[str, list[int]], now: dict[str, list[int]]) -> tuple[list[str], list[str]]:
    """Between two commits of one family: the configurations that fail now and passed every case
    before (a new defect in a family that already failed), and those that failed before and pass
    every case now. Only configurations checked at both commits count: others say nothing."""
    started = [k for k, (applied, failed) in now.items() if failed and k in before and before[k][0] and not before[k][1]]
    stopped = [k for k, (applied, failed) in now.items() if applied and not failed and k in before and before[k][1]]
    return started, stopped


_PLAIN = {"tp": "1", "dtype": "fp32", "regime": "normal", "chunks": "none", "mask": "unmasked",
          "layout": "contiguous", "context": "train", "frozen": "none", "cp": "none"}


def describe(keys: list[str]) -> str:
    """A few configurations in words, each by what it has beyond the plain path, for a history line."""
    shown = []
    for key in keys[:3]:
        c = parse_config(key)
        said = [_PHRASES.get(dim, {}).get(c[dim], f"{dim} {c[dim]}") for dim in CONFIG_FIELDS
                if dim in c and c[dim] != _PLAIN.get(dim)]
        shown.append(", ".join(said) or "on the plain path")
    return "; ".join(shown) + (f"; and {len(keys) - 3} more" if len(keys) > 3 else "")


@dataclass
class FamilyStats:
    """A family's count over a run: cases checked, new findings (of which beyond the target's use),
    known findings, and per configuration [cases checked, cases failed]."""
    check: str
    term: str = ""
    context: str = ""
    applied: int = 0
    failed: int = 0
    beyond: int = 0
    known: int = 0
    configs: dict[str, list[int]] = field(default_factory=dict)

    def count(self, case: Case, failed: bool) -> None:
        self.applied += 1
        cell = self.configs.setdefault(config_key(case), [0, 0])
        cell[0] += 1
        cell[1] += failed

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "term": self.term, "context": self.context,
                "label": family_label(self.check, self.term, self.context), "applied": self.applied,
                "failed": self.failed, "beyond": self.beyond, "known": self.known, "configs": self.configs}
