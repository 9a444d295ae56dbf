"""Hypothesis strategies over cases. They draw a handful of scalars; tensors come from the case's
seed, so drawing is cheap and shrinking works on shapes and settings, not on tensor entries.

Lists are ordered simplest first: Hypothesis shrinks towards the front.
"""
from __future__ import annotations

import random

from hypothesis import strategies as st

from harness.cases.case import (
    CONTEXTS,
    CP_LAYOUTS,
    DISTILL_CONTEXTS,
    DISTILL_FUNCTIONS,
    DISTILL_REGIMES,
    DIVERGENCES,
    DRIFT,
    DTYPES,
    FROZEN,
    HIDDEN_VIEWS,
    LAYOUTS,
    LINEAR_CONTEXTS,
    LINEAR_REGIMES,
    LOSS_TERMS,
    MASKS,
    REGIMES,
    TEACHERS,
    TOKEN_LAYOUTS,
    TOP_P,
    DistillCase,
    KernelCase,
    LinearCase,
    WrapperCase,
)

TP_SIZES = (1, 2, 4)
SEEDS = st.integers(0, 2**31 - 1)
COEFS = (None, 0.0, -0.0, 1e-8, -0.01, 0.5, 1e3)  # absent, zero, signed zero, tiny, negative, large
TEMPERATURES = (None, 1.0, 0.7, 1.3)
WRAPPER_DTYPES = ("fp32", "bf16", "fp16")


def _chunk(draw, rows: int) -> int:
    """-1, 1, a divisor and a non-divisor of the row count, and more than the row count."""
    divisors = [d for d in range(2, rows) if rows % d == 0]
    non_divisors = [d for d in range(2, rows) if rows % d]
    options = [-1, 1, rows + 3]
    if divisors:
        options.append(draw(st.sampled_from(divisors)))
    if non_divisors:
        options.append(draw(st.sampled_from(non_divisors)))
    return draw(st.sampled_from(options))


# The deep-accumulation regime: many row chunks (T 128-256, chunks of 1-2 rows: 64-256 chunks) at
# small H and V_local, so it stays cheap. A dW summed over chunks in bf16/fp16 exceeds the bound by
# 2-4x at 128-256 chunks on drifting data, and by at most 1.15x at 32 (scripts/studies/deep_accumulation.py,
# docs/tolerances.md); the shallow draws (T <= 24) make at most two dozen chunks. The regime is
# drawn at TP 1 only: the error it looks for is each rank's own arithmetic, and at TP > 1 every chunk
# pays its collectives (hundreds of them per case, seconds on a loaded CPU). The corpus holds one.
DEEP_T = (128, 256)
DEEP_CHUNKS = (1, 2)
# About one TP-1 draw in this many is deep: the linear level, where dW sums over the chunks, more
# often (it draws a fifth as many cases as the kernel level).
KERNEL_DEEP_ONE_IN = 8
LINEAR_DEEP_ONE_IN = 4


def _deep(draw, tp: int, one_in: int) -> dict | None:
    """The deep regime's T and chunk size, about one TP-1 draw in `one_in` (drawn last, so that
    the other draws are unchanged), else None."""
    if tp != 1 or draw(st.integers(0, one_in - 1)) != one_in - 1:
        return None
    return dict(T=draw(st.integers(*DEEP_T)), chunk_size=draw(st.sampled_from(DEEP_CHUNKS)))


def _mostly_first(options: tuple[str, ...]) -> st.SearchStrategy:
    """The first (today's, simplest) option about half the time, each other option evenly; shrinks
    to the first."""
    return st.one_of(st.just(options[0]), st.sampled_from(options))


def _how_called(draw) -> dict:
    """How the caller lays out the logits and tokens and calls the routine. The training context
    about three times in four: the others cost a second call (docs/callers.md)."""
    context = st.one_of(st.just(CONTEXTS[0]), st.just(CONTEXTS[0]), st.sampled_from(CONTEXTS))
    return dict(layout=draw(_mostly_first(LAYOUTS)), token_layout=draw(_mostly_first(TOKEN_LAYOUTS)),
                context=draw(context))


@st.composite
def kernel_cases(draw, tp=st.sampled_from(TP_SIZES), dtype=st.sampled_from(("fp32", "bf16", "fp16")),
                 masked: bool | None = None, entropy: bool = True, keep_mask: bool = True,
                 dp=st.just(1)) -> KernelCase:
    """Level-1 cases. `entropy`/`keep_mask` False restrict to what a target can do; `dp`: the
    data-parallel replicas around the TP group (drawn last, so DP 1 draws are unchanged)."""
    T = draw(st.one_of(st.sampled_from((1, 2, 3, 5, 7, 11, 13, 0)), st.integers(0, 24)))
    v_local = draw(st.one_of(st.sampled_from((4, 1, 2, 3, 5, 7, 13)), st.integers(1, 32)))
    mask_options = MASKS if masked is None else (MASKS[1:] if masked else MASKS[:1])
    if not keep_mask:
        mask_options = MASKS[:1]
    with_entropy = entropy and draw(st.booleans())
    case = KernelCase(
        tp=draw(tp), T=T, v_local=v_local, dtype=draw(dtype),
        regime=draw(st.sampled_from(REGIMES)),
        chunk_size=_chunk(draw, T),
        mask=draw(st.sampled_from(mask_options)),
        with_entropy=with_entropy,
        with_entropy_grad=draw(st.booleans()),
        requires_grad=draw(st.sampled_from((True, False))),
        loss_terms=draw(st.sampled_from(LOSS_TERMS)) if with_entropy else "both",
        seed=draw(SEEDS),
        dp=draw(dp),
        **_how_called(draw),
    )
    deep = _deep(draw, case.tp, KERNEL_DEEP_ONE_IN)
    if deep is None:
        return case
    # Small rows, so that hundreds of chunks stay cheap; no keep mask or second call to pay for.
    return case.replace(**deep, v_local=draw(st.integers(1, 4)), mask="none", context="train")


@st.composite
def wrapper_cases(draw, tp=st.sampled_from(TP_SIZES), top_p: bool | None = None,
                  entropy: bool = True, keep_mask: bool = True, dp=st.just(1), cp=st.just(1)) -> WrapperCase:
    """Level-2 cases: packed batches of 1-4 samples with responses of 0..L-1 tokens. `cp`: the
    context-parallel size (drawn last, with its layout, so CP 1 draws are unchanged)."""
    n = draw(st.integers(1, 4))
    totals = tuple(draw(st.integers(1, 8)) for _ in range(n))
    responses = tuple(draw(st.integers(0, L - 1)) for L in totals)
    top_p_options = TOP_P if top_p is None else (TOP_P[1:] if top_p else TOP_P[:1])
    if not keep_mask:
        top_p_options = TOP_P[:1]
    case = WrapperCase(
        tp=draw(tp), v_local=draw(st.one_of(st.sampled_from((4, 1, 3, 7)), st.integers(1, 16))),
        total_lengths=totals, response_lengths=responses,
        entropy_coef=draw(st.sampled_from(COEFS)),
        temperature=draw(st.sampled_from(TEMPERATURES)),
        chunk_size=_chunk(draw, sum(totals)),
        with_entropy=entropy and draw(st.booleans()),
        top_p=draw(st.sampled_from(top_p_options)),
        regime=draw(st.sampled_from(("normal", "peaked", "ties", "huge", "fartail"))),
        seed=draw(SEEDS),
        dp=draw(dp),
        **_how_called(draw),
        **_context_parallel(draw, cp),
    )
    # The logits' dtype, for a wrapper that takes bf16 or fp16 (`cases.capabilities`), at temperature 1
    # only (a division in the logits' dtype rounds the kernel's input at that dtype's scale, which no
    # float32-scale bound covers): read off the seed, not drawn, so every draw and every case of a
    # float32-only wrapper stays as it is; the seed shrinks to 0, float32.
    if case.temperature not in (None, 1.0):
        return case
    return case.replace(dtype=WRAPPER_DTYPES[case.seed % len(WRAPPER_DTYPES)])


def _context_parallel(draw, cp: st.SearchStrategy) -> dict:
    size = draw(cp)
    return dict(cp=size, cp_layout=draw(st.sampled_from(CP_LAYOUTS))) if size > 1 else {}


@st.composite
def linear_cases(draw, tp=st.sampled_from(TP_SIZES), dtype=st.sampled_from(("fp32", "bf16", "fp16")),
                 entropy: bool = True, keep_mask: bool = True, dp=st.just(1)) -> LinearCase:
    """Fused-linear cases (docs/fused-linear.md): small T, H and V_local, so the level costs a tenth
    of the kernel's time. `keep_mask` and `dp` are the other levels' knobs: this level has no keep
    mask, and its cases run in one TP group."""
    T = draw(st.one_of(st.sampled_from((1, 2, 3, 5, 7, 11, 0)), st.integers(0, 24)))
    with_entropy = entropy and draw(st.booleans())
    case = LinearCase(
        tp=draw(tp), T=T,
        H=draw(st.one_of(st.sampled_from((8, 1, 3, 16, 64)), st.integers(1, 64))),
        v_local=draw(st.one_of(st.sampled_from((4, 1, 3, 7, 32)), st.integers(1, 32))),
        dtype=draw(dtype),
        regime=draw(st.sampled_from(LINEAR_REGIMES)),
        chunk_size=_chunk(draw, T),
        with_entropy=with_entropy,
        with_entropy_grad=draw(st.booleans()),
        requires_grad=draw(st.sampled_from((True, False))),
        loss_terms=draw(st.sampled_from(LOSS_TERMS)) if with_entropy else "both",
        seed=draw(SEEDS),
    )
    # Drawn last, so the draws above are unchanged: one frozen input about one time in three (a
    # frozen LM head or trunk), the second call on other inputs about one in four, the deep regime.
    frozen = draw(_mostly_first(FROZEN))
    case = case.replace(frozen=frozen if case.requires_grad else FROZEN[0],
                        context=draw(st.one_of(st.just(LINEAR_CONTEXTS[0]), st.sampled_from(LINEAR_CONTEXTS))))
    deep = _deep(draw, case.tp, LINEAR_DEEP_ONE_IN)
    if deep is not None:
        case = case.replace(**deep, H=draw(st.integers(1, 16)), v_local=draw(st.integers(1, 8)), regime=DRIFT,
                            context="train")
    # Last of all, so every draw above is unchanged: the hidden states as a strided view about half the time.
    return case.replace(hidden_view=draw(_mostly_first(HIDDEN_VIEWS)))


@st.composite
def distill_cases(draw, tp=st.sampled_from(TP_SIZES), dtype=st.sampled_from(("fp32", "bf16", "fp16")),
                  entropy: bool = True, keep_mask: bool = True, dp=st.just(1)) -> DistillCase:
    """Distillation cases (docs/distill.md): T 0-16, V_local 1-32, each function (the divergence about
    half the time), every divergence and teacher, k from 1 to beyond V_local, renormalized or not,
    a temperature about one case in three, every regime (ties within and across shards, a masked
    vocabulary, disjoint top-k), a differentiable teacher, the teacher equal to the student, strided
    student logits and calls under no_grad now and then. `entropy` and `keep_mask` are the other
    levels' knobs: this level has neither."""
    T = draw(st.one_of(st.sampled_from((1, 2, 3, 5, 7, 0)), st.integers(0, 16)))
    v_local = draw(st.one_of(st.sampled_from((4, 1, 2, 3, 5, 7, 13)), st.integers(1, 32)))
    function = draw(st.one_of(st.just(DISTILL_FUNCTIONS[0]), st.sampled_from(DISTILL_FUNCTIONS)))
    teacher = draw(st.sampled_from(TEACHERS))
    kind = draw(st.sampled_from(DIVERGENCES))
    k = draw(st.sampled_from((1, 2, 4, 7, v_local, v_local + 1, 2 * v_local + 1)))
    renormalize = draw(st.booleans())
    temperature = draw(st.sampled_from((1.0, 1.0, 0.7, 2.0)))
    if teacher == "given" and not renormalize:
        temperature = 1.0
    divergence = function == "divergence"
    case = DistillCase(
        tp=draw(tp), T=T, v_local=v_local, function=function,
        kind=kind if divergence else DIVERGENCES[0], teacher=teacher if divergence else TEACHERS[0],
        k=k, beta=draw(st.sampled_from((0.5, 0.1, 0.9))), renormalize=renormalize, temperature=temperature,
        dtype=draw(dtype), regime=draw(st.sampled_from(DISTILL_REGIMES)), chunk_size=_chunk(draw, T),
        requires_grad=function != "topk", seed=draw(SEEDS), dp=draw(dp),
    )
    # Drawn last, so the draws above are unchanged: a differentiable teacher, the teacher equal to
    # the student, the student's logits as a view, a call without autograd.
    teacher_grad = divergence and teacher != "given" and draw(st.integers(0, 3)) == 0
    self_teacher = divergence and kind != "soft_ce" and draw(st.integers(0, 5)) == 0
    return case.replace(teacher_grad=teacher_grad, self_teacher=self_teacher, layout=draw(_mostly_first(LAYOUTS)),
                        context=draw(st.one_of(st.just(DISTILL_CONTEXTS[0]), st.just(DISTILL_CONTEXTS[0]),
                                               st.sampled_from(DISTILL_CONTEXTS))))




# Every combination the distillation contract names for a divergence (docs/distill.md): kind x teacher x
# renormalization, each at a temperature other than 1 where the contract allows one (a teacher pass's
# top-k used as given, not renormalized, is taken at temperature 1). A full teacher's support is the whole
# vocabulary, where renormalizing changes nothing: its kinds are taken once each.
DISTILL_COMBINATIONS: tuple[tuple[str, str, bool], ...] = tuple(
    (kind, teacher, renormalize) for teacher in TEACHERS for renormalize in ((True,) if teacher == "full" else
                                                                             (True, False)) for kind in DIVERGENCES)
# And each other function (the gather renormalized or not) in the far tail, where a floor (`log(p + eps)`)
# or a clamp of the log-probs hides: the student's log-probs at the gathered ids reach -50 to -115.
FAR_TAIL_FUNCTIONS: tuple[tuple[str, bool], ...] = (("log_softmax", True), ("topk", True), ("gather", True),
                                                    ("gather", False))


def distill_cover(tps: list[int], seed: int, budget: int, dp: int = 1) -> list[DistillCase]:
    """The covering draw of the distillation level: one divergence case per combination of
    `DISTILL_COMBINATIONS` (the regimes in turn, so that the far tail meets every kind), then one case of
    each of `FAR_TAIL_FUNCTIONS` in the far tail; the TP sizes assigned round-robin (shifted by the
    seed, so that seeds rotate each combination over the sizes), every other field drawn from the seed.
    A random draw of `budget` cases would miss some of them (a defect of one combination is then found
    or not by the seed and the TP sizes); the explorer runs these first, in the budget, and draws the
    rest at random. None when the budget cannot hold them and a random case besides.

    Each case can show its combination's defects: T >= 1, a support of 2 <= k < V entries (where a
    renormalization and a temperature change the values), a weight other than 1/2 (where swapping a
    mixture's weights changes it), a teacher other than the student."""
    slots = [(DISTILL_FUNCTIONS[0], kind, teacher, renormalize) for kind, teacher, renormalize in DISTILL_COMBINATIONS] \
        + [(function, DIVERGENCES[0], TEACHERS[0], renormalize) for function, renormalize in FAR_TAIL_FUNCTIONS]
    if budget <= len(slots) or not tps:
        return []
    rng = random.Random(f"distill-cover:{seed}:{dp}")
    cases = []
    for i, (function, kind, teacher, renormalize) in enumerate(slots):
        tp = tps[(i + seed) % len(tps)]
        # Small shapes mostly, as the random draws' (which start from the simplest): T 1-16, V_local 3-16
        # (room for 2 <= k < V, and for a support within one shard, where a gather of the whole vocabulary shows).
        T = rng.choice((1, 2, 3, 5, 7, rng.randint(1, 16)))
        v_local = rng.choice((4, 3, 5, 7, 8, rng.randint(3, 16)))
        k = rng.choice([c for c in (2, 4, 7, v_local, v_local + 1) if 2 <= c < tp * v_local] or [2])
        divergence = function == DISTILL_FUNCTIONS[0]
        if divergence:  # the regimes in turn; a temperature other than 1 where the contract allows one
            regime = DISTILL_REGIMES[(i + seed) % len(DISTILL_REGIMES)]
            temperature = 1.0 if teacher == "given" and not renormalize else rng.choice((0.7, 2.0))
        else:  # the far tail at temperatures that keep it below -50
            regime, temperature = "fartail", rng.choice((1.0, 0.7))
        cases.append(DistillCase(
            tp=tp, T=T, v_local=v_local, function=function, kind=kind, teacher=teacher, k=k,
            beta=rng.choice((0.1, 0.9)), renormalize=renormalize if teacher != "full" or not divergence
            else rng.random() < 0.5, temperature=temperature,
            dtype=rng.choice(tuple(DTYPES)), regime=regime, chunk_size=rng.choice((-1, 1, 2, T + 3)),
            requires_grad=function != "topk", teacher_grad=divergence and teacher != "given" and rng.random() < 0.25,
            seed=rng.randrange(2**31), dp=dp, layout=rng.choice((LAYOUTS[0],) + LAYOUTS),
            context=DISTILL_CONTEXTS[1] if rng.random() < 1 / 6 else DISTILL_CONTEXTS[0]))
    return cases
