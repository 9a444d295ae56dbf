"""Cases: specs round-trip, inputs are deterministic and shard-consistent, strategies cover the
required corners, and the regression corpus names real checks."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cases.case import REGIMES, KernelCase, WrapperCase, parse_case
from harness.cases.corpus import CORPUS
from harness.cases.strategies import kernel_cases, wrapper_cases
from harness.checks import all_checks


@given(st.one_of(kernel_cases(), wrapper_cases()))
def test_spec_round_trips(case):
    assert parse_case(case.spec()) == case


def test_signed_zero_and_absent_survive_the_spec():
    w = WrapperCase(tp=2, v_local=3, total_lengths=(3,), response_lengths=(1,), entropy_coef=-0.0, temperature=None)
    back = parse_case(w.spec())
    assert back.temperature is None and math.copysign(1.0, back.entropy_coef) == -1.0


@pytest.mark.parametrize("spec", ["nonsense", "kernel:tp=2,bogus=1", "kernel:tp"])
def test_bad_spec_is_a_value_error(spec):
    with pytest.raises(ValueError):
        parse_case(spec)


def test_inputs_are_deterministic_and_independent_of_tp():
    a = KernelCase(tp=2, T=9, v_local=6, mask="random", regime="peaked", seed=11).inputs()
    b = KernelCase(tp=4, T=9, v_local=3, mask="random", regime="peaked", seed=11).inputs()
    assert torch.equal(a.logits, b.logits) and torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.keep_mask, b.keep_mask)


def test_tokens_hit_the_edges_of_every_shard():
    case = KernelCase(tp=4, T=16, v_local=5)
    tokens = set(case.inputs().tokens.tolist())
    edges = {i for r in range(4) for i in (5 * r, 5 * r + 4)}
    assert edges <= tokens


def test_neginf_regime_keeps_targets_finite():
    inp = KernelCase(tp=1, T=20, v_local=7, regime="neginf", seed=3).inputs()
    assert torch.isneginf(inp.logits).any()
    assert torch.isfinite(inp.logits[torch.arange(20), inp.tokens]).all()


def test_mask_kinds():
    only = KernelCase(tp=1, T=5, v_local=4, mask="only_target").inputs()
    assert not only.keep_mask.any()
    drop = KernelCase(tp=1, T=5, v_local=4, mask="drop_target").inputs()
    assert not drop.keep_mask[torch.arange(5), drop.tokens].any()


def test_partial_top_p_draws_every_encoding_slime_receives():
    """Empty recorded nuclei, short offsets (rows without a nucleus), lists and int32 tensors, and
    never a None: over a few seeds, every one of them appears."""
    seen = set()
    for seed in range(40):
        w = WrapperCase(tp=1, v_local=6, total_lengths=(8, 8), response_lengths=(5, 6), top_p="partial",
                        seed=seed).inputs()
        for ids, offs, R in zip(w.top_p_token_ids, w.top_p_token_offsets, (5, 6), strict=True):
            assert ids is not None and offs is not None
            seen.add(type(ids).__name__)
            offs = [int(o) for o in offs]
            seen.add("short" if len(offs) < R + 1 else "full")
            if any(b == a for a, b in zip(offs, offs[1:], strict=False)):
                seen.add("empty")
            if len(offs) <= 1:
                seen.add("none recorded")
            assert len(ids) == (offs[-1] if offs else 0)
    assert seen >= {"list", "Tensor", "short", "full", "empty", "none recorded"}


def test_the_kernel_strategy_covers_the_corners():
    """Over 300 derandomized draws: T 0, 1 and primes; V_local 1 and primes; chunk sizes whole, over
    T, one row and part of T; every dtype, regime, mask kind and TP size."""
    seen: dict[str, set] = {}

    @settings(max_examples=300, derandomize=True)
    @given(kernel_cases())
    def draw(case):
        seen.setdefault("T", set()).add(case.T)
        seen.setdefault("v", set()).add(case.v_local)
        seen.setdefault("chunk", set()).add("whole" if case.chunk_size < 0 else "over" if case.chunk_size > case.T
                                            else "one" if case.chunk_size == 1 else "part")
        for field in ("dtype", "regime", "mask", "tp"):
            seen.setdefault(field, set()).add(getattr(case, field))

    draw()
    assert {0, 1} <= seen["T"] and seen["T"] & {5, 7, 11, 13}
    assert 1 in seen["v"] and seen["v"] & {3, 5, 7, 13}
    assert seen["chunk"] == {"whole", "over", "one", "part"}
    assert seen["dtype"] == {"fp32", "bf16", "fp16"} and seen["tp"] == {1, 2, 4}
    assert seen["regime"] == {"normal", "peaked", "huge", "ties", "neginf", "fartail"} == set(REGIMES)
    assert seen["mask"] == {"none", "random", "drop_target", "only_target"}


def test_corpus_entries_name_registered_checks_and_are_unique():
    names = [e.name for e in CORPUS]
    assert len(names) == len(set(names))
    for e in CORPUS:
        assert e.check in all_checks(), e
        assert e.history


def test_corpus_runs_clean_on_the_builtin(harness_runner):
    from harness.driver.explorer import run_corpus

    assert run_corpus(harness_runner, [1, 2, 4]) == []


def test_half_precision_wrapper_logits_are_drawn_without_temperature_and_float32_specs_stay():
    """bf16 and fp16 wrapper logits, for a wrapper that takes them, at temperature 1 only: a division in
    the logits' dtype rounds the kernel's input beyond float32 scale."""
    dtypes: set[str] = set()

    @settings(max_examples=200, derandomize=True)
    @given(wrapper_cases())
    def draw(case):
        assert case.dtype == "fp32" or case.temperature in (None, 1.0)
        assert case.inputs().logits.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16,
                                              "fp16": torch.float16}[case.dtype]
        dtypes.add(case.dtype)

    draw()
    assert dtypes == {"fp32", "bf16", "fp16"}
    case = WrapperCase(tp=2, v_local=3, total_lengths=(3,), response_lengths=(1,))
    assert "dtype" not in case.spec() and parse_case(case.replace(dtype="bf16").spec()).dtype == "bf16"


def test_regimes_are_one_registry_entry_each_and_existing_draws_are_unchanged():
    """`LOGIT_REGIMES` holds each kernel and wrapper regime; a regime's entry turns the N(0, 1) logits
    drawn first into its own, so adding one changes no other regime's values (a case's spec keeps
    naming the same inputs). The far tail keeps each row's largest entry among the rest."""
    from harness.cases.case import LOGIT_REGIMES, _logits

    assert tuple(LOGIT_REGIMES) == REGIMES
    g = torch.Generator().manual_seed(11)
    first = torch.randn(5, 9, generator=g, dtype=torch.float64)
    assert torch.equal(_logits(torch.Generator().manual_seed(11), 5, 9, "normal", torch.float64), first)
    x = _logits(torch.Generator().manual_seed(11), 5, 9, "fartail", torch.float64)
    assert torch.equal(x.argmax(-1), first.argmax(-1))
    assert ((x == first) | (first - x >= 50) & (first - x <= 110)).all() and (x < first).any()
