"""Which output a problem is about, and which term of the loss a wrong gradient comes from.

A check declared with `terms=True` names, in each problem, the output it is about: the log-prob,
the entropy, or a gradient (`named_output`). A finding is about one term (`TERMS`), so a case whose
log-probs and entropy are both wrong gives two findings, one per family. A gradient is the sum of
the terms in the loss; with both in it, the same case with one term alone is a case the harness can
run (`alone`): at the kernel and fused-linear levels `loss_terms=log_prob` and `loss_terms=entropy`;
at the wrapper level only the log-prob term runs alone (`with_entropy=0`), so the entropy term's
verdict is inferred from it (`gradient_terms`).
"""
from __future__ import annotations

import re
from typing import Callable

from harness.cases.case import Case, KernelCase, LinearCase, WrapperCase
from harness.checks import CheckFn, Evidence

_NAMES = {"log_prob": "log-prob", "entropy": "entropy"}
TERMS = ("log-prob", "entropy")
TERM_LEVELS = ("kernel", "wrapper", "linear")  # the levels whose outputs are a log-prob and an entropy
GRADIENT = "gradient"  # a problem about a gradient: its term is the loss's (`gradient_terms`)
# The first output a problem names is its subject ("rank 0 log_prob: worst at ...", "grad (all
# shards): ...", "entropy vs TP 1"); `with_entropy`, `requires_grad`, `entropy_coef` name no output.
_OUTPUT = re.compile(r"\b(entropy|log[_-]probs?|grad\w*|gradients?)\b")


def split_by_term(chk_terms: bool, case: Case) -> bool:
    """Whether a check's problems on `case` are split by term: a `terms` check at a level of `TERM_LEVELS`."""
    return chk_terms and case.level in TERM_LEVELS


def named_output(problem: str) -> str:
    """The output a problem of a `terms` check is about: a term of `TERMS`, `GRADIENT`, or "" (none named)."""
    m = _OUTPUT.search(problem)
    if m is None:
        return ""
    word = m.group(1)
    return "entropy" if word == "entropy" else "log-prob" if word.startswith("log") else GRADIENT


def loss_terms(case: Case) -> tuple[str, ...]:
    """The terms whose gradient the case's loss carries (none without a backward)."""
    if not case.grad_on:
        return ()
    if isinstance(case, WrapperCase):
        return ("log-prob", "entropy") if case.expects_entropy_grad else ("log-prob",)
    assert isinstance(case, (KernelCase, LinearCase))
    lp = case.loss_terms != "entropy"
    ent = case.loss_terms != "log_prob" and case.expects_entropy_grad
    return tuple(t for t, on in (("log-prob", lp), ("entropy", ent)) if on)


def exercised(case: Case) -> tuple[str, ...]:
    """The terms a `terms` check looks at in this case: the log-prob always, the entropy when asked for."""
    return ("log-prob", "entropy") if case.with_entropy else ("log-prob",)


def alone(case: Case) -> dict[str, Case]:
    """The same case with one term alone in the loss, per term that can run alone."""
    if isinstance(case, WrapperCase):
        return {"log-prob": case.replace(with_entropy=False)}
    return {"log-prob": case.replace(loss_terms="log_prob"), "entropy": case.replace(loss_terms="entropy")}


def gradient_terms(case: Case, wrong_alone: Callable[[Case], bool | None]) -> tuple[str, ...]:
    """Which terms a wrong gradient of `case` comes from: the only term in its loss, or, with both,
    the terms whose case alone (`alone`) still has a wrong gradient (`wrong_alone(case)`: None when
    that case could not be judged). () when it cannot be told: the sum is wrong while each term
    alone is right, or a case alone did not get through its backward."""
    in_loss = loss_terms(case)
    if len(in_loss) < 2:
        return in_loss
    verdicts = {term: wrong_alone(c) for term, c in alone(case).items()}
    if None in verdicts.values():
        return ()
    if isinstance(case, WrapperCase):  # the entropy term cannot run alone: inferred from the log-prob's
        return ("log-prob",) if verdicts["log-prob"] else ("entropy",)
    return tuple(t for t in TERMS if verdicts[t])


def _alone(run: Callable[[Case], Evidence], case: Case, check: CheckFn) -> bool | None:
    """Whether `check` passes on `case` (None: the case did not get through its backward)."""
    ev = run(case)
    return not check(ev) if ev.completed("backward") else None


def kernel_terms(ev: Evidence, run: Callable[[Case], Evidence], check: CheckFn) -> str:
    """The verdict on each loss term of a failing kernel or fused-linear gradient."""
    c = ev.case
    assert isinstance(c, (KernelCase, LinearCase))
    if c.loss_terms != "both" or not c.expects_entropy_grad:
        term = "entropy" if c.loss_terms == "entropy" else "log_prob"
        why = f"loss_terms={c.loss_terms}" if c.loss_terms != "both" else "the entropy carries no gradient here"
        return f"the {_NAMES[term]} term's gradient is wrong (the only term in this loss: {why})"
    ok = {term: _alone(run, c.replace(loss_terms=term), check) for term in _NAMES}
    specs = {term: f"loss_terms={term}" for term in _NAMES}
    if None in ok.values():
        return ""
    if ok["log_prob"] and ok["entropy"]:
        return ("each term's gradient alone is right (loss_terms=log_prob and loss_terms=entropy pass): "
                "their sum is wrong (one term's gradient overwrites or drops the other's)")
    if not ok["log_prob"] and not ok["entropy"]:
        return "both terms' gradients are wrong: the case fails with loss_terms=log_prob and with loss_terms=entropy"
    bad, good = ("entropy", "log_prob") if ok["log_prob"] else ("log_prob", "entropy")
    return (f"the {_NAMES[bad]} term's gradient is wrong: the same case fails with {specs[bad]} "
            f"and passes with {specs[good]}")


def wrapper_terms(ev: Evidence, run: Callable[[Case], Evidence], check: CheckFn) -> str:
    """The verdict on each loss term of a failing wrapper gradient (the entropy term is in the loss
    exactly when entropy_coef != 0)."""
    c = ev.case
    if not c.expects_entropy_grad:
        return "the log-prob term's gradient is wrong (the only term in this loss: entropy_coef is 0 or absent)"
    ok = _alone(run, c.replace(with_entropy=False), check)
    if ok is None:
        return ""
    if ok:
        return ("the entropy term's gradient is wrong: the same case with the log-prob term alone "
                "(with_entropy=0) passes")
    return ("the log-prob term's gradient is wrong: the same case fails with the log-prob term alone "
            "(with_entropy=0); the entropy term cannot run alone at the wrapper level")
