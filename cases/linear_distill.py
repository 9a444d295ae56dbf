"""The fused-linear distillation level's cases (docs/linear-distill.md): a student's hidden states
`[T, H]` and LM head `[V, H]`, a teacher's hidden states and head (or its logits `[T, V]`), labels
with ignored tokens, and the distillation loss a trainer takes over them, chunked over the tokens.

The routines of this family (Liger's chunked JSD, torchtune's chunked forward KL, TRL's GKD loss) run
on one rank: a case's `tp` is 1 whatever TP sizes a run asks for (the pools place a case by its TP size).

Named for its level, as `levels/linear_distill.py` declares it and `reference/`, `engine/`, `checks/`,
`targets/fused_linear_distill.py` and `mutants/linear_distill.py` hold its parts."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from hypothesis import strategies as st

from harness.cases.case import DTYPES, CaseBase, choice

LD_KINDS = ("forward_kl", "reverse_kl", "jsd", "soft_ce")
LD_DTYPES = ("fp32", "bf16")  # the LM head's dtypes in training
# head: the teacher's hidden states and head, its logits made chunk by chunk; logits: its logits given.
LD_TEACHERS = ("head", "logits")
# all / random / empty: every / a random ~70% (at least one) / no label valid (the others ignore_index).
LD_LABELS = ("all", "random", "empty")
# normal: logits ~N(0, 2^2) on both sides; peaked: the teacher confident (one logit ~12 above its row);
# disjoint: the teacher's logits twice the student's negated (its top entries the student's bottom);
# self: the teacher is the student (every divergence 0, its gradient 0).
LD_REGIMES = ("normal", "peaked", "disjoint", "self")
LD_BETAS = (0.1, 0.5, 0.9)
LD_TEMPERATURES = (1.0, 0.7, 2.0)
LD_WEIGHTS = ((0.0, 1.0), (0.5, 0.5), (0.3, 0.7), (1.0, 0.0))  # (hard, soft), Liger's default the second
IGNORE_INDEX = -100
_SCALE = 2.0  # the logits' standard deviation
_SPIKE = 12.0


class LDInputs(NamedTuple):
    student_hidden: torch.Tensor  # [T, H], the case's dtype
    student_weight: torch.Tensor  # [V, H]
    teacher_hidden: torch.Tensor  # [T, H_t], or the teacher's logits [T, V] (teacher "logits")
    teacher_weight: torch.Tensor | None  # [V, H_t], or None
    labels: torch.Tensor  # [T] int64, IGNORE_INDEX where ignored
    weight: float  # the upstream gradient of the loss


@dataclass(frozen=True)
class LinearDistillCase(CaseBase):
    """`linear_distill_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, ...)`.
    The inputs come from (seed, T, H, V, regime, teacher, labels, dtype) only."""
    tp: int
    T: int
    H: int
    v_local: int  # the vocabulary (one rank holds it all)
    kind: str = choice("jsd", LD_KINDS)
    beta: float = 0.5
    temperature: float = 1.0
    hard_weight: float = 0.0
    soft_weight: float = 1.0
    chunk_size: int = -1
    dtype: str = choice("fp32", LD_DTYPES)
    teacher: str = choice("head", LD_TEACHERS)
    labels: str = choice("random", LD_LABELS)
    regime: str = choice("normal", LD_REGIMES)
    seed: int = 0
    dp: int = 1
    context: ClassVar[str] = "train"
    level: ClassVar[str] = "linear_distill"
    with_entropy: ClassVar[bool] = False
    expects_entropy_grad: ClassVar[bool] = False
    requires_grad: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = []
        if self.tp != 1:
            problems.append("tp=1: the level's routines run on one rank")
        if self.T < 1 or self.H < 1 or self.v_local < 2:
            problems.append("T >= 1, H >= 1, v_local >= 2")
        if self.kind == "jsd" and not 0.0 < self.beta < 1.0:
            problems.append("jsd takes 0 < beta < 1 (beta 0 and 1 are forward_kl and reverse_kl)")
        if not self.temperature > 0:
            problems.append("temperature > 0")
        if self.chunk_size == 0 or self.chunk_size < -1:
            problems.append("chunk_size -1 (one pass) or >= 1")
        if problems:
            raise ValueError(f"invalid linear_distill case: {'; '.join(problems)}")

    @property
    def teacher_hidden_size(self) -> int:
        return self.H + 3  # a teacher wider than its student, as distillation's are

    has_backward = True
    loss_takes_every_output = True
    grad_on = True

    def group(self) -> str:
        hard = "+hard" if self.hard_weight else ""
        temp = f"-t{self.temperature:g}" if self.temperature != 1.0 else ""
        return f"{self.level}-{self.kind}{hard}{temp}-{self.teacher}"

    def inputs(self) -> LDInputs:
        g = torch.Generator().manual_seed(self.seed)
        T, H, V, Ht = self.T, self.H, self.v_local, self.teacher_hidden_size
        hs = torch.randn(T, H, generator=g, dtype=torch.float64)
        ws = torch.randn(V, H, generator=g, dtype=torch.float64) * (_SCALE / math.sqrt(H))
        ht = torch.randn(T, Ht, generator=g, dtype=torch.float64)
        wt = torch.randn(V, Ht, generator=g, dtype=torch.float64) * (_SCALE / math.sqrt(Ht))
        if self.regime == "peaked":  # the teacher's hidden state pushed along one row of its head
            top = torch.randint(0, V, (T,), generator=g)
            w = wt[top]
            ht = ht + _SPIKE * w / w.pow(2).sum(-1, keepdim=True).clamp_min(1e-12)
        elif self.regime in ("disjoint", "self"):
            sign = -2.0 if self.regime == "disjoint" else 1.0
            ht = torch.cat([hs, torch.zeros(T, Ht - H, dtype=torch.float64)], dim=1)
            wt = torch.cat([sign * ws, torch.randn(V, Ht - H, generator=g, dtype=torch.float64)], dim=1)
        keep = {"all": torch.ones(T, dtype=torch.bool), "empty": torch.zeros(T, dtype=torch.bool)}.get(
            self.labels, torch.rand(T, generator=g) < 0.7)
        if self.labels == "random" and not keep.any():
            keep[int(torch.randint(0, T, (1,), generator=g))] = True  # no valid label is `empty`'s case
        ids = torch.randint(0, V, (T,), generator=g)
        labels = torch.where(keep, ids, torch.full_like(ids, IGNORE_INDEX))
        weight = float(torch.randn((), generator=g))
        dtype = DTYPES[self.dtype]
        hs, ws, ht, wt = hs.to(dtype), ws.to(dtype), ht.to(dtype), wt.to(dtype)
        if self.teacher == "logits":  # the teacher's logits as its forward returns them, in its dtype
            return LDInputs(hs, ws, (ht.double() @ wt.double().T).to(dtype), None, labels, weight)
        return LDInputs(hs, ws, ht, wt, labels, weight)


# What a routine of the level may lack, as capabilities (`HARNESS = Declaration(capabilities=...)`):
# a divergence by its name (`forward_kl`, `reverse_kl`, `jsd`, `soft_ce`: the distillation level's
# names); `temperature` (other than 1); `hard_loss` (a hard-label cross-entropy term, hard_weight != 0);
# `teacher_head` / `teacher_logits` (the teacher's hidden states and head, or its logits); `chunk_size`
# (a chunk of tokens the caller chooses). A routine without one is given the nearest case it takes.
LD_CAPABILITIES = (*LD_KINDS, "temperature", "hard_loss", "teacher_head", "teacher_logits", "chunk_size")


def fit_linear_distill(case: LinearDistillCase, supports: Any) -> LinearDistillCase:
    """The nearest case whose divergence, temperature, hard loss, teacher and chunking the routine takes."""
    changes: dict[str, Any] = {}
    if not supports(case.kind):
        kind = next((k for k in LD_KINDS if supports(k)), case.kind)
        changes.update(kind=kind, beta=case.beta if kind == "jsd" else 0.5)
    if case.temperature != 1.0 and not supports("temperature"):
        changes["temperature"] = 1.0
    if case.hard_weight and not supports("hard_loss"):
        changes.update(hard_weight=0.0, soft_weight=1.0)
    if not supports(f"teacher_{case.teacher}"):
        changes["teacher"] = next((t for t in LD_TEACHERS if supports(f"teacher_{t}")), case.teacher)
    if case.chunk_size != -1 and not supports("chunk_size"):
        changes["chunk_size"] = -1
    return case.replace(**changes) if changes else case


@st.composite
def linear_distill_cases(draw: Any, tp: Any = None, dp: Any = None, **_: Any) -> LinearDistillCase:
    """Cases at TP 1, whatever TP sizes the run asks for: T 1-24, H 1-16, V 2-48, every divergence
    (jsd at beta 0.1, 0.5, 0.9), temperature, loss weights, teacher, labels, regime and dtype, chunked
    about two cases in three (a chunk that splits the valid tokens unevenly included)."""
    T = draw(st.integers(1, 24))
    kind = draw(st.sampled_from(LD_KINDS))
    hard, soft = draw(st.sampled_from(LD_WEIGHTS))
    chunked = draw(st.sampled_from((True, True, False)))
    return LinearDistillCase(
        tp=1, T=T, H=draw(st.integers(1, 16)), v_local=draw(st.integers(2, 48)), kind=kind,
        beta=draw(st.sampled_from(LD_BETAS)) if kind == "jsd" else 0.5,
        temperature=draw(st.sampled_from(LD_TEMPERATURES)), hard_weight=hard, soft_weight=soft,
        chunk_size=draw(st.integers(1, T)) if chunked else -1, dtype=draw(st.sampled_from(LD_DTYPES)),
        teacher=draw(st.sampled_from(LD_TEACHERS)), labels=draw(st.sampled_from(("all", "random", "random", "all", "random", "random", "random", "empty"))),
        regime=draw(st.sampled_from(LD_REGIMES)), seed=draw(st.integers(0, 2**31 - 1)))


def linear_distill_cover(tps: list[int], seed: int, budget: int, dp: int = 1) -> list[LinearDistillCase]:
    """The level's covering draw: one case per divergence (jsd at a weight other than 1/2, where swapping
    the mixture's weights shows) and teacher form, each at a temperature other than 1, chunked unevenly
    over randomly ignored labels, the hard loss in every other one, the regimes and dtypes in turn, over
    vocabularies of 16 to 200 (where arithmetic in bf16 shows); every other field drawn from the seed. A random draw of the budget would reach some combinations only by
    chance; the explorer runs these first. None when the budget cannot hold them and a random case besides."""
    slots = [(kind, teacher) for kind in LD_KINDS for teacher in LD_TEACHERS]
    if budget <= len(slots) or not tps:
        return []
    rng = random.Random(f"linear-distill-cover:{seed}")
    cases = []
    for i, (kind, teacher) in enumerate(slots):
        T = rng.randint(5, 16)
        hard, soft = LD_WEIGHTS[2] if i % 2 else LD_WEIGHTS[0]
        cases.append(LinearDistillCase(
            tp=1, T=T, H=rng.randint(2, 12), v_local=rng.randint(16, 200), kind=kind,
            beta=rng.choice((0.1, 0.9)) if kind == "jsd" else 0.5, temperature=rng.choice((0.7, 2.0)),
            hard_weight=hard, soft_weight=soft, chunk_size=rng.randint(2, T - 1), dtype=LD_DTYPES[(i + seed) % 2],
            teacher=teacher, labels="random", regime=LD_REGIMES[(i + seed) % 3], seed=rng.randrange(2**31)))
    return cases
