"""What a case asks of a routine beyond the contract's core, and how to fit a case to a routine that
declares it lacks something (`HARNESS_CAPABILITIES` of a target: no entropy, no keep mask).

Every path that makes cases (strategies, the corpus, twins, the benchmark cases) goes through the
runner, which fits each case with `fit` before it runs: a routine is never sent an input it said it
does not take, and a finding is never about a feature the routine does not claim.
"""
from __future__ import annotations

from typing import Callable

from cases.case import Case, KernelCase, LinearCase

CAPABILITIES = ("entropy", "keep_mask")


def needs(case: Case) -> set[str]:
    """The capabilities this case uses."""
    out = set()
    if case.with_entropy:
        out.add("entropy")
    if getattr(case, "mask", "none") != "none" or getattr(case, "top_p", "none") != "none":
        out.add("keep_mask")
    return out


def fit(case: Case, supports: Callable[[str], bool]) -> Case:
    """The nearest case that needs only what `supports` allows (the case itself when it does)."""
    if case.with_entropy and not supports("entropy"):
        case = case.replace(with_entropy=False, loss_terms="both") if isinstance(case, (KernelCase, LinearCase)) \
            else case.replace(with_entropy=False)
    if "keep_mask" in needs(case) and not supports("keep_mask"):
        case = case.replace(mask="none") if isinstance(case, KernelCase) else case.replace(top_p="none")
    return case
