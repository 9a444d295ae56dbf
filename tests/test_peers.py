"""The megatron-core peer as a target: log-prob-only capabilities, and what the checks find in it.

Runs on the session's pools (the plugin's `harness_pools` fixture), no pools of its own.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cases.case import KernelCase
from harness.engine.explorer import strategy_for
from harness.engine.runner import Runner
from harness.targets import load_target

MEGATRON = "harness.targets.megatron"
# Every kernel check on the log-prob path; input-integrity is asserted on its own below.
LOG_PROB_CHECKS = {"crash", "empty-input", "collectives", "values", "gradients", "grad-flags",
                   "shapes-dtypes", "finite", "chunk-invariance", "tp-invariance"}


@pytest.fixture(scope="module")
def megatron(harness_pools) -> Runner:
    return Runner(MEGATRON, pools=harness_pools)


def test_declares_log_prob_only() -> None:
    target = load_target(MEGATRON)
    assert target.levels == ("kernel",)
    assert not target.supports("entropy") and not target.supports("keep_mask")


@settings(max_examples=100, database=None, deadline=None)
@given(st.data())
def test_draws_nothing_it_cannot_compute(data) -> None:
    case = data.draw(strategy_for(SimpleNamespace(target=load_target(MEGATRON)), "kernel", (1, 2, 4)))
    assert not case.with_entropy and case.mask == "none"


def test_says_what_it_does_not_provide() -> None:
    from harness.targets.megatron import calculate_log_probs_and_entropy

    with pytest.raises(NotImplementedError, match="computes no entropy"):
        calculate_log_probs_and_entropy(None, None, None, with_entropy=True)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_passes_log_prob_checks(megatron: Runner, tp: int, dtype: str) -> None:
    """Values at float32 scale in every input dtype (megatron upcasts before its math), gradients,
    collectives and the invariances, at TP 1, 2 and 4; peaked rows, -inf entries, chunk sizes, T == 0."""
    cases = [KernelCase(tp=tp, T=7, v_local=5, dtype=dtype, regime=regime, chunk_size=chunk, with_entropy=False,
                        seed=11 * tp + i)
             for i, (regime, chunk) in enumerate([("normal", -1), ("peaked", 3), ("neginf", -1), ("huge", 2)])]
    cases += [KernelCase(tp=tp, T=0, v_local=3, dtype=dtype, with_entropy=False),
              KernelCase(tp=tp, T=5, v_local=4, dtype=dtype, with_entropy=False, requires_grad=False, seed=5)]
    for case in cases:
        _, findings = megatron.check(case, only=LOG_PROB_CHECKS)
        assert not findings, f"{findings[0].check}: {findings[0].message}\n{findings[0].repro}"


@pytest.mark.distributed
def test_float32_logits_are_overwritten(megatron: Runner) -> None:
    """A finding about megatron-core 0.16.1 itself (Megatron-LM PR #1594, still open): `.float()` is a
    no-op on float32 input, so its in-place `-=`/`exp(out=)`/`div_` write the softmax into the
    caller's logits. Half-precision inputs are copied by the upcast and stay intact."""
    for dtype, mutated in (("fp32", True), ("bf16", False)):
        _, findings = megatron.check(KernelCase(tp=2, T=5, v_local=4, dtype=dtype, with_entropy=False, seed=1594),
                                     only={"input-integrity"})
        assert bool(findings) == mutated, dtype
        if mutated:
            assert "values changed after forward" in findings[0].message
