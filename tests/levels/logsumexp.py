"""A fifth level built from docs/architecture.md's recipe, as a user would: the per-token
log-sum-exp of vocab-sharded logits, `calculate_logsumexp(logits, tp_group, chunk_size=-1)`.

Each part a real level keeps in its own file sits here in one: the case class (`cases/`), the
float64 oracle (`reference/`), the rank-side call (`harness/engine/`), the judge (`harness/checks/`)
and the `Level` object, registered by the last line. Unpickling a case in a pool worker imports this
module, so the workers know the level too."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from hypothesis import strategies as st

from harness.base.levels import Counts, Level, register
from harness.cases.case import CaseBase, choice
from harness.checks import Evidence
from harness.checks.oracle import Expected
from harness.checks.tolerance import U32
from harness.engine.calls import shard, tp_group
from harness.engine.observations import Observation, TensorMeta
from harness.targets import Contract, Target

NAME = "probe-lse"


# ------------------------------------------------------------------ the case (cases/)
@dataclass(frozen=True)
class LseCase(CaseBase):
    tp: int
    T: int
    v_local: int
    chunk_size: int = -1
    seed: int = 0
    dp: int = 1
    context: str = choice("train", ("train",))
    level: ClassVar[str] = NAME
    with_entropy: ClassVar[bool] = False
    grad_on: ClassVar[bool] = True
    has_backward: ClassVar[bool] = True
    loss_takes_every_output: ClassVar[bool] = True
    expects_entropy_grad: ClassVar[bool] = False

    def group(self) -> str:
        return f"{self.level}-tp{self.tp}"

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed)
        return torch.randn(self.T, self.vocab, generator=g) * 3, torch.randn(self.T, generator=g)


@st.composite
def lse_cases(draw: Any, tp: st.SearchStrategy = st.sampled_from((1, 2)), dp: st.SearchStrategy = st.just(1),
              **_: Any) -> LseCase:
    T = draw(st.integers(1, 9))
    return LseCase(tp=draw(tp), T=T, v_local=draw(st.integers(1, 7)), chunk_size=draw(st.sampled_from((-1, 1, 2, 4))),
                   seed=draw(st.integers(0, 2**16)), dp=draw(dp))


# ------------------------------------------------------------------ the oracle (reference/)
def expected(case: LseCase) -> Expected:
    logits, w = (t.to(torch.float64) for t in case.inputs())
    lse = torch.logsumexp(logits, dim=-1)
    grad = torch.softmax(logits, dim=-1) * w[:, None]
    # float32 scale: a few roundings of the largest magnitude involved, per entry.
    tol = 16 * U32 * (logits.abs().amax(-1) + lse.abs() + 1)
    return Expected(log_prob=lse, entropy=None, grad=grad, entropy_requires_grad=False, log_prob_tol=tol,
                    entropy_tol=None, grad_tol=16 * U32 * (grad.abs() + w.abs()[:, None] / case.vocab + 1e-30))


# ------------------------------------------------------------------ the rank side (harness/engine/)
def run(case: LseCase, target: Target, rank: int, group: Any, device: torch.device, obs: Observation,
        meter_memory: bool = True, cp_rank: int = 0) -> None:
    logits, w = case.inputs()
    x = shard(logits, rank, case.v_local, device).requires_grad_(True)
    fn = target.routine(NAME)
    assert fn is not None  # a case runs only at the levels its target has
    out = fn(x, tp_group(), chunk_size=case.chunk_size)
    obs.log_prob, obs.log_prob_meta, obs.stage = out.detach().clone(), TensorMeta.of(out), "forward"
    (out.reshape(-1) * w.to(device)).sum().backward()
    obs.grad, obs.grad_meta, obs.stage = x.grad, TensorMeta.of(x.grad), "backward"


# ------------------------------------------------------------------ the judge (harness/checks/)
class LseJudge:
    def values(self, ev: Evidence) -> list[str]:
        return [p for r in ev.ranks
                for p in ev.compare(r.obs.log_prob, ev.expected.log_prob, ev.expected.log_prob_tol, f"{r.name} lse")]

    def gradients(self, ev: Evidence) -> list[str]:
        grad = ev.full_grad()
        if grad is None:
            return ["no gradient reached the logits"]
        return ev.compare(grad, ev.expected.grad, ev.expected.grad_tol, "grad (all shards)")

    def grad_flags(self, ev: Evidence) -> list[str]:
        return [f"{r.name}: lse does not require grad" for r in ev.ranks
                if r.obs.log_prob_meta is not None and not r.obs.log_prob_meta.requires_grad]  # type: ignore[union-attr]

    def shapes_dtypes(self, ev: Evidence) -> list[str]:
        return [f"{r.name}: lse {r.obs.log_prob_meta.dtype}{list(r.obs.log_prob_meta.shape)}, expected float32[{ev.case.T}]"
                for r in ev.ranks if r.obs.log_prob_meta is not None  # type: ignore[union-attr]
                and (r.obs.log_prob_meta.dtype, list(r.obs.log_prob_meta.shape)) != ("float32", [ev.case.T])]  # type: ignore[union-attr]

    def finite(self, ev: Evidence) -> list[str]:
        got = ev.obs().log_prob
        return [] if not isinstance(got, torch.Tensor) or torch.isfinite(got).all() else ["lse: non-finite entries"]

    def outputs_match(self, ev: Evidence, other: Evidence, what: str) -> list[str]:
        a, b = ev.obs().log_prob, other.obs().log_prob
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            return []
        return ev.compare(a, b.to(torch.float64), 2 * ev.expected.log_prob_tol, f"lse vs {what}")

    def gradient_terms(self, ev: Evidence, run: Any) -> str:
        return ""


# ------------------------------------------------------------------ the level (harness/levels/), registered
LEVEL = register(Level(
    name=NAME, case_class=LseCase,
    contracts={NAME: Contract("calculate_logsumexp", ("logits", "tp_group"), dict(chunk_size=-1))},
    strategy=lse_cases, run=run, expected=expected, judge=LseJudge(),
    evidence=frozenset({"call", "oracle"}), counts=Counts(cases={"smoke": 8, "ci": 12})))
