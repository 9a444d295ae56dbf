"""Which term of the loss a problem is about, and which term a wrong gradient comes from.

A check declared with `terms=True` says, of each problem, the output it is about: the log-prob,
the entropy, or a gradient (`Problem.output`, `checks.problems`). A finding is about one term (`TERMS`), so a case whose
log-probs and entropy are both wrong gives two findings, one per family. A gradient is the sum of
the terms in the loss; with both in it, the same case with one term alone is a case the harness can
run (`alone`): at the kernel and fused-linear levels `loss_terms=log_prob` and `loss_terms=entropy`;
at the wrapper level only the log-prob term runs alone (`with_entropy=0`), so the entropy term's
verdict is inferred from it (`gradient_terms`).
"""
from __future__ import annotations

from typing import Any, Callable

from harness.base import levels
from harness.cases.case import Case
from harness.checks import CheckFn, Evidence
from harness.checks.problems import ENTROPY, LOG_PROB

_NAMES = {"log_prob": "log-prob", "entropy": "entropy"}
TERMS = (LOG_PROB, ENTROPY)


class TokenTerms:
    """The loss terms of a level whose outputs are a log-prob and an entropy per token, each of
    which can be left out of the loss (`loss_terms`): the kernel's and the fused-linear level's."""

    def in_loss(self, case: Any) -> tuple[str, ...]:
        lp = case.loss_terms != "entropy"
        ent = case.loss_terms != "log_prob" and case.expects_entropy_grad
        return tuple(t for t, on in (("log-prob", lp), ("entropy", ent)) if on)

    def alone(self, case: Any) -> dict[str, Case]:
        return {"log-prob": case.replace(loss_terms="log_prob"), "entropy": case.replace(loss_terms="entropy")}

    def wrong(self, verdicts: dict[str, bool]) -> tuple[str, ...]:
        """The terms whose case alone is wrong."""
        return tuple(t for t in TERMS if verdicts[t])


class WrapperTerms(TokenTerms):
    """The wrapper's: the entropy term is in the loss exactly when entropy_coef != 0, and only the
    log-prob term can run alone (`with_entropy=0`), so the entropy term's verdict is inferred from it."""

    def in_loss(self, case: Any) -> tuple[str, ...]:
        return ("log-prob", "entropy") if case.expects_entropy_grad else ("log-prob",)

    def alone(self, case: Any) -> dict[str, Case]:
        return {"log-prob": case.replace(with_entropy=False)}

    def wrong(self, verdicts: dict[str, bool]) -> tuple[str, ...]:
        return ("log-prob",) if verdicts["log-prob"] else ("entropy",)


TOKEN_TERMS = TokenTerms()
WRAPPER_TERMS = WrapperTerms()


def split_by_term(chk_terms: bool, case: Case) -> bool:
    """Whether a check's problems on `case` are split by term: a `terms` check at a level with terms."""
    return chk_terms and levels.of(case).terms is not None


def loss_terms(case: Case) -> tuple[str, ...]:
    """The terms whose gradient the case's loss carries (none without a backward, or at a level without terms)."""
    terms = levels.of(case).terms
    return terms.in_loss(case) if terms is not None and case.grad_on else ()


def exercised(case: Case) -> tuple[str, ...]:
    """The terms a `terms` check looks at in this case: the log-prob always, the entropy when asked for."""
    return ("log-prob", "entropy") if case.with_entropy else ("log-prob",)


def alone(case: Case) -> dict[str, Case]:
    """The same case with one term alone in the loss, per term that can run alone."""
    terms = levels.of(case).terms
    return terms.alone(case) if terms is not None else {}


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
    return levels.of(case).terms.wrong(verdicts)


def each_term_alone(case: Case, target: Any) -> dict[str, Case]:
    """What a gradient finding's explanation runs (`Explain.related`): the case with each term alone
    in the loss, by term, where both are in it."""
    return alone(case) if len(loss_terms(case)) > 1 else {}


def _passes(ev: Evidence | None, check: CheckFn) -> bool | None:
    """Whether `check` passes on a related case's evidence (None: not run, or not through its backward)."""
    return not check(ev) if ev is not None and ev.completed("backward") else None


def kernel_terms(ev: Evidence, related: dict[str, Evidence], check: CheckFn) -> str:
    """The verdict on each loss term of a failing kernel or fused-linear gradient, from the evidence
    of the case with each term alone (`each_term_alone`)."""
    c: Any = ev.case
    if c.loss_terms != "both" or not c.expects_entropy_grad:
        term = "entropy" if c.loss_terms == "entropy" else "log_prob"
        why = f"loss_terms={c.loss_terms}" if c.loss_terms != "both" else "the entropy carries no gradient here"
        return f"the {_NAMES[term]} term's gradient is wrong (the only term in this loss: {why})"
    ok = {term: _passes(related.get(name), check) for term, name in _NAMES.items()}
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


def _entropy_came_back_differentiable(ev: Evidence) -> bool:
    """Whether some rank's call returned an entropy that requires grad (per sample at the wrapper)."""
    for r in ev.ranks:
        meta = getattr(r.obs, "entropy_meta", None)
        if any(m is not None and m.requires_grad for m in (meta if isinstance(meta, list) else [meta])):
            return True
    return False


def wrapper_terms(ev: Evidence, related: dict[str, Evidence], check: CheckFn) -> str:
    """The verdict on each loss term of a failing wrapper gradient (the entropy term is in the loss
    exactly when entropy_coef != 0), from the evidence of the log-prob term alone (`each_term_alone`)."""
    c = ev.case
    if not c.expects_entropy_grad:
        if _entropy_came_back_differentiable(ev):
            return ("the entropy came back differentiable with entropy_coef 0 or absent (`entropy-coef-rule`), and "
                    "the loss weighs every differentiable output: the gradient holds an entropy term that the "
                    "expected gradient, of the log-prob term alone, does not")
        return "the log-prob term's gradient is wrong (the only term in this loss: entropy_coef is 0 or absent)"
    ok = _passes(related.get(LOG_PROB), check)
    if ok is None:
        return ""
    if ok:
        return ("the entropy term's gradient is wrong: the same case with the log-prob term alone "
                "(with_entropy=0) passes")
    return ("the log-prob term's gradient is wrong: the same case fails with the log-prob term alone "
            "(with_entropy=0); the entropy term cannot run alone at the wrapper level")
