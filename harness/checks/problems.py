"""A check's problem: the sentence a finding prints, with what it is about told where it was found.

A check returns its problems; the driver turns them into findings, one per family (`checks.families`),
and never reads a problem's words to tell which output it is about: `output` says so, set by the check
(or by `tolerance.compare`, which fills in the worst entry too). A problem is a `str`, so it prints,
joins and slices as the sentence it is; a check that names no output may return plain strings.
"""
from __future__ import annotations

from typing import Any

LOG_PROB = "log-prob"
ENTROPY = "entropy"
GRADIENT = "gradient"  # a gradient: its term is the loss's (`terms.gradient_terms`)
OUTPUTS = (LOG_PROB, ENTROPY, GRADIENT)
# What the contract's output keys (the observations' and the oracle's attribute names) are about.
KEY_OUTPUTS = {"log_prob": LOG_PROB, "log_probs": LOG_PROB, "entropy": ENTROPY, "grad": GRADIENT,
               "grad_hidden": GRADIENT}


class Problem(str):
    """One thing wrong, as a check found it. `output`: "log-prob", "entropy", "gradient" or "" (no
    output named); `index`, `actual`, `expected`, `bound`: where a comparison found it worst (the
    rank is in the sentence, as the check's `what` names it)."""
    output: str
    index: tuple[int, ...] | None
    actual: float | None
    expected: float | None
    bound: float | None

    def __new__(cls, text: str, output: str = "", *, index: tuple[int, ...] | None = None,
                actual: float | None = None, expected: float | None = None, bound: float | None = None) -> "Problem":
        if output and output not in OUTPUTS:
            raise ValueError(f"a problem is about one of {OUTPUTS} or nothing, not {output!r}")
        self = super().__new__(cls, text)
        self.output, self.index = output, index
        self.actual, self.expected, self.bound = actual, expected, bound
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (str(self), self.output, self.index, self.actual, self.expected, self.bound))


def _rebuild(text: str, output: str, index: tuple[int, ...] | None, actual: float | None,
             expected: float | None, bound: float | None) -> Problem:
    return Problem(text, output, index=index, actual=actual, expected=expected, bound=bound)


def about(output: str, problems: list[str]) -> list[str]:
    """`problems` about `output` (those that already name one keep theirs)."""
    return [p if isinstance(p, Problem) and p.output else Problem(p, output) for p in problems]


def output_of(problem: str) -> str:
    """What a problem is about, as its check said ("" for a plain string: no output named)."""
    return problem.output if isinstance(problem, Problem) else ""
