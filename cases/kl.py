"""The KL-estimator level's cases (docs/kl.md): per-token KL estimators between a policy's and a
reference's log-probs, `[T]` each, as every PPO/GRPO trainer computes them for its KL penalty or loss.

The routine is per-token, not vocab-parallel: no collective, no shard. A case runs on one rank
(`tp` is 1 whatever TP sizes a run asks for: the pools place a case by its TP size).

Named for its level, as `levels/kl.py` declares it and `cases/kl.py`, `reference/kl.py`, `engine/kl.py`,
`checks/kl.py` and `mutants/kl.py` hold its parts: a level keeps one module name across the layers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
from hypothesis import strategies as st

from harness.cases.case import AUTOGRAD_OFF, DTYPES, CaseBase, choice

KL_KINDS = ("k1", "k2", "k3")
KL_REDUCTIONS = ("none", "token_mean", "sum")
KL_DTYPES = ("fp32", "bf16")  # what trainers hold log-probs in; fp16 log-probs overflow k3's far tail
# normal: a policy near its reference; wide: log-ratios of a few units; fartail: about half the tokens
# at log-ratios of +-20 and beyond (to +-60 unclamped, where float32's exp still holds k3; to +-200
# where a clamp holds it); zero: the policy is its reference, every log-ratio exactly 0.
KL_REGIMES = ("normal", "wide", "fartail", "zero")
# none: no mask given; all / random / empty: a bool mask with every / a random ~70% / no token valid;
# float: a random 0/1 float32 mask (verl's response_mask).
KL_MASKS = ("none", "all", "random", "empty", "float")
KL_CONTEXTS = ("train", "no_grad")
KL_CLAMPS = (None, 10.0, 20.0)
_BOUNDARY = 1e-3  # log-ratios this close to +-clamp are moved to 0: the clamp's gradient flips there


class KLInputs(NamedTuple):
    log_probs: torch.Tensor  # [T], the case's dtype
    ref_log_probs: torch.Tensor  # [T], the case's dtype
    mask: torch.Tensor | None  # [T] bool or float32 0/1, or None
    weight: torch.Tensor  # the upstream weight: [T] for reduction "none", a scalar otherwise (float32)


@dataclass(frozen=True)
class KLCase(CaseBase):
    """`kl_estimate(log_probs, ref_log_probs, kind, mask, reduction, clamp)` on `[T]` log-probs. The
    inputs come from (seed, T, regime, dtype, mask, clamp) only."""
    tp: int
    T: int
    kind: str = choice("k3", KL_KINDS)
    reduction: str = choice("none", KL_REDUCTIONS)
    dtype: str = choice("fp32", KL_DTYPES)
    regime: str = choice("normal", KL_REGIMES)
    mask: str = choice("none", KL_MASKS)
    clamp: float | None = None
    requires_grad: bool = True  # the policy's log-probs
    seed: int = 0
    dp: int = 1
    context: str = choice("train", KL_CONTEXTS)
    level: ClassVar[str] = "kl"
    with_entropy: ClassVar[bool] = False
    expects_entropy_grad: ClassVar[bool] = False
    v_local: ClassVar[int] = 1  # no vocabulary
    chunk_size: ClassVar[int] = -1  # no chunks

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = []
        if self.tp != 1:
            problems.append("tp=1: the level is per-token, not vocab-parallel")
        if self.T < 0:
            problems.append("T >= 0")
        if self.T == 0 and self.reduction != "none":
            # The empty call returns an empty `[0]` (`empty-input`); a reduction over no valid token is
            # the empty mask's case, at T > 0.
            problems.append("T=0 takes reduction=none (a reduction over no token: mask=empty)")
        if self.clamp is not None and not self.clamp > 0:
            problems.append("clamp > 0 (or absent)")
        if problems:
            raise ValueError(f"invalid kl case: {'; '.join(problems)}")

    @property
    def grad_on(self) -> bool:
        return self.requires_grad and self.context not in AUTOGRAD_OFF

    has_backward = grad_on
    loss_takes_every_output = grad_on

    def group(self) -> str:
        clamp = f"-clamp{self.clamp:g}" if self.clamp is not None else ""
        return f"{self.level}-{self.kind}-{self.reduction}{clamp}"

    def inputs(self) -> KLInputs:
        g = torch.Generator().manual_seed(self.seed)
        T = self.T
        base = -(torch.randn(T, generator=g, dtype=torch.float64).abs() * 1.5)
        if self.regime == "wide":
            x = 3.0 * torch.randn(T, generator=g, dtype=torch.float64)
        elif self.regime == "fartail":
            x = 0.3 * torch.randn(T, generator=g, dtype=torch.float64)
            far = torch.rand(T, generator=g) < 0.5
            if T:
                far[int(torch.randint(0, T, (1,), generator=g))] = True
            reach = 40.0 if self.clamp is None else 180.0
            depth = 20.0 + reach * torch.rand(T, generator=g, dtype=torch.float64)
            sign = torch.where(torch.rand(T, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
            x = torch.where(far, sign * depth, x)
        else:
            x = 0.3 * torch.randn(T, generator=g, dtype=torch.float64)
        if self.regime == "zero":
            x = torch.zeros(T, dtype=torch.float64)
        # Both log-probs <= 0: the larger of the two is `base`.
        policy, ref = base + x.clamp(max=0.0), base - x.clamp(min=0.0)
        dtype = DTYPES[self.dtype]
        policy, ref = policy.to(dtype), ref.to(dtype)
        if self.clamp is not None:
            r = policy.to(torch.float64) - ref.to(torch.float64)
            near = (r.abs() - self.clamp).abs() < _BOUNDARY * (1.0 + self.clamp)
            policy = torch.where(near, ref, policy)
        if self.mask == "none":
            mask = None
        else:
            keep = {"all": torch.ones(T, dtype=torch.bool), "empty": torch.zeros(T, dtype=torch.bool)}.get(
                self.mask, torch.rand(T, generator=g) < 0.7)
            if self.mask in ("random", "float") and T and not keep.any():
                keep[0] = True  # no valid token is the `empty` mask's case, not a random one's
            mask = keep.to(torch.float32) if self.mask == "float" else keep
        shape = (T,) if self.reduction == "none" else ()
        weight = torch.randn(shape, generator=g)
        return KLInputs(policy, ref, mask, weight)


# What a routine of the level may not take, as capabilities (`HARNESS = Declaration(capabilities=...)`):
# `kl_clamp`, the log-ratio clamp (OpenRLHF's estimator has none); `kl_sum`, the masked sum;
# `kl_masked_tokens`, a mask on the per-token estimates (reduction "none": OpenRLHF masks only in its
# mean); an estimator by its name (`k1`, `k2`, `k3`: a loss that computes one of them); `kl_per_token`
# and `kl_token_mean`, the reductions "none" and "token_mean" (a reported metric that is a mean only, a
# function that leaves the reduction to its caller); `kl_differentiable`, a gradient (a logged metric,
# detached). A routine without one is given the nearest case it takes.
KL_CAPABILITIES = ("kl_clamp", "kl_sum", "kl_masked_tokens", *KL_KINDS, "kl_per_token", "kl_token_mean",
                   "kl_differentiable")
_REDUCTION_CAPABILITY = {"none": "kl_per_token", "token_mean": "kl_token_mean", "sum": "kl_sum"}


def fit_kl(case: KLCase, supports: Any) -> KLCase:
    """The nearest case whose estimator, clamp, reduction, per-token mask and gradient the routine takes."""
    changes: dict[str, Any] = {}
    if not supports(case.kind):
        changes["kind"] = next((k for k in KL_KINDS if supports(k)), case.kind)
    if case.clamp is not None and not supports("kl_clamp"):
        changes["clamp"] = None
    if not supports(_REDUCTION_CAPABILITY[case.reduction]):
        # A sum is nearest a token mean; a mean and the per-token estimates are nearest each other.
        order = {"sum": ("token_mean", "none"), "token_mean": ("none", "sum"), "none": ("token_mean", "sum")}
        changes["reduction"] = next((r for r in order[case.reduction] if supports(_REDUCTION_CAPABILITY[r])),
                                    case.reduction)
    if changes.get("reduction", case.reduction) != "none" and case.T == 0:
        changes.update(T=1, mask="empty")  # no token to reduce: the empty mask's case
    if changes.get("reduction", case.reduction) == "none" and case.mask != "none" and not supports("kl_masked_tokens"):
        changes["mask"] = "none"
    if case.requires_grad and not supports("kl_differentiable"):
        changes["requires_grad"] = False
    return case.replace(**changes) if changes else case


@st.composite
def kl_cases(draw: Any, tp: Any = None, dp: Any = None, **_: Any) -> KLCase:
    """KL cases at TP 1, whatever TP sizes the run asks for (the level has no shards); T from 0 (the
    empty call, reduction "none") to 40, every kind, reduction, mask, regime, clamp and dtype."""
    regime = draw(st.sampled_from(KL_REGIMES))
    T = 0 if draw(st.sampled_from((False,) * 9 + (True,))) else draw(st.integers(1, 40))  # the empty call: rarely
    return KLCase(
        tp=1, T=T, kind=draw(st.sampled_from(KL_KINDS)),
        reduction=draw(st.sampled_from(KL_REDUCTIONS)) if T else "none", dtype=draw(st.sampled_from(KL_DTYPES)), regime=regime,
        mask=draw(st.sampled_from(KL_MASKS)),
        # The far tail is mostly clamped, as trainers run it; unclamped it stays where float32 holds k3.
        clamp=draw(st.sampled_from(KL_CLAMPS[1:] if regime == "fartail" and draw(st.booleans()) else KL_CLAMPS)),
        requires_grad=draw(st.sampled_from((True, True, True, False))),
        context=draw(st.sampled_from(("train", "train", "train", "no_grad"))),
        seed=draw(st.integers(0, 2**31 - 1)))

