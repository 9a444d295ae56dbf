"""Which term of the loss a wrong gradient comes from. With both outputs in the loss, the gradient
is the log-prob term's plus the entropy term's, and the same case with one term alone is a case
the harness can run: at the kernel and fused-linear levels `loss_terms=log_prob` and
`loss_terms=entropy`; at the wrapper level only the log-prob term runs alone (`with_entropy=0`),
so the entropy term's verdict is inferred from it."""
from __future__ import annotations

from typing import Callable

from harness.cases.case import Case, KernelCase, LinearCase
from harness.checks import CheckFn, Evidence

_NAMES = {"log_prob": "log-prob", "entropy": "entropy"}


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
