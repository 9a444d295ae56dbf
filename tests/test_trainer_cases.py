"""Cases real trainers make: a frozen LM head or trunk, two calls on different inputs in
one graph, deep accumulation over many row chunks, and the memory allowance every memory check
reads. One rank in-process (TP 1, no process group), as tests/test_callers.py runs them; the
mutants' kills at TP 1, 2, 4 are in the last test."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

from harness.cases.case import DRIFT, FROZEN, KernelCase, LinearCase, WrapperCase, parse_case
from harness.cases.corpus import CORPUS
from harness.cases.strategies import DEEP_CHUNKS, DEEP_T, kernel_cases, linear_cases
from harness.checks import Evidence, all_checks
from harness.checks.memory import allowance, budget_use
from harness.commands.mutate import CLEAN, kill_matrix, run_catalog
from harness.engine.executor import run_on_rank
from harness.meters import memory_meter
from harness.targets import load_target

CPU = torch.device("cpu")
FUSED = "harness.targets.fused"
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "studies" / "deep_accumulation.py"
NEW_MUTANTS = ("saved-beside-ctx", "linear-saved-beside-ctx", "linear-no-weight-grad-if-hidden-frozen",
               "linear-frozen-weight-grad-computed", "linear-weight-grad-low-precision-sum")


def _evidence(case, target_spec: str = FUSED) -> Evidence:
    target = load_target(target_spec)
    return Evidence(case, target, [run_on_rank(case, target, 0, CPU)])


def _problems(case, target_spec: str = FUSED) -> dict[str, list[str]]:
    """Every applicable twin-free check's problems, by check."""
    ev = _evidence(case, target_spec)
    assert not ev.failed_ranks, ev.ranks[0].error
    return {name: p for name, chk in all_checks().items()
            if chk.twin is None and chk.applicable(case, ev.target) and (p := chk.fn(ev))}


# ------------------------------------------------------------------ the case fields

def test_new_fields_leave_earlier_specs_unchanged_and_parse_back():
    case = LinearCase(tp=2, T=5, H=4, v_local=3, seed=1)
    assert "frozen" not in case.spec() and "context" not in case.spec()
    for frozen in FROZEN:
        for context in ("train", "two_inputs"):
            c = case.replace(frozen=frozen, context=context)
            assert parse_case(c.spec()) == c


def test_second_call_has_other_inputs_of_the_same_shape():
    k = KernelCase(tp=2, T=6, v_local=5, context="two_inputs", seed=3)
    a, b = k.inputs(), k.second().inputs()
    assert k.second().context == "train" and a.logits.shape == b.logits.shape
    assert not torch.equal(a.logits, b.logits) and not torch.equal(a.tokens, b.tokens)
    lin = LinearCase(tp=2, T=6, H=4, v_local=5, context="two_inputs", seed=3)
    assert not torch.equal(lin.inputs().hidden, lin.second().inputs().hidden)


@settings(max_examples=400, derandomize=True, database=None, deadline=None)
@given(linear_cases())
def test_linear_strategy_frozen_only_with_grad_and_deep_in_range(case):
    if not case.requires_grad:
        assert case.frozen == "none"
    if case.T > 24:
        assert DEEP_T[0] <= case.T <= DEEP_T[1] and case.chunk_size in DEEP_CHUNKS and case.regime == DRIFT


def test_strategies_draw_the_new_cases():
    seen: set[str] = set()

    @settings(max_examples=300, derandomize=True, database=None, deadline=None)
    @given(kernel_cases())
    def kernel(case):
        seen.add("kernel-deep" if case.T > 24 else case.context)

    @settings(max_examples=200, derandomize=True, database=None, deadline=None)
    @given(linear_cases())
    def linear(case):
        seen.update({f"frozen-{case.frozen}", f"linear-{case.context}", *(("linear-deep",) if case.T > 24 else ())})

    kernel()
    linear()
    assert {"kernel-deep", "two_inputs", "frozen-weight", "frozen-hidden", "linear-two_inputs", "linear-deep"} <= seen


# ------------------------------------------------------------------ the built-in routine passes

@pytest.mark.parametrize("case", [
    LinearCase(tp=1, T=6, H=8, v_local=5, frozen="weight", seed=1),
    LinearCase(tp=1, T=6, H=8, v_local=5, frozen="hidden", dtype="bf16", seed=2),
    LinearCase(tp=1, T=6, H=8, v_local=5, context="two_inputs", chunk_size=4, seed=3),
    LinearCase(tp=1, T=128, H=4, v_local=3, dtype="bf16", regime=DRIFT, chunk_size=1, seed=4),
    KernelCase(tp=1, T=6, v_local=5, context="two_inputs", mask="random", chunk_size=4, seed=5),
    WrapperCase(tp=1, v_local=5, total_lengths=(5, 4), response_lengths=(3, 2), entropy_coef=0.1,
                context="two_inputs", seed=6),
], ids=lambda c: c.spec())
def test_builtin_passes(case):
    assert _problems(case) == {}


CONTROLS = ("unshifted", "online", "gather", "twopass_pairwise", "inplace_grad", "autograd_collective")


@pytest.mark.parametrize("name", CONTROLS)
def test_controls_pass_the_new_kernel_and_wrapper_cases(name):
    """Zero false findings on the new case paths (the controls have no linear level)."""
    for case in (KernelCase(tp=1, T=7, v_local=6, context="two_inputs", mask="random", chunk_size=3, dtype="bf16", seed=1),
                 KernelCase(tp=1, T=200, v_local=3, chunk_size=1, seed=2),
                 WrapperCase(tp=1, v_local=5, total_lengths=(5, 4), response_lengths=(3, 2), entropy_coef=0.1,
                             context="two_inputs", chunk_size=2, seed=3)):
        assert _problems(case, f"tests.controls.{name}") == {}


def test_frozen_input_gets_no_gradient_and_the_other_is_checked():
    ev = _evidence(LinearCase(tp=1, T=6, H=8, v_local=5, frozen="weight", seed=1))
    assert ev.obs().grad is None and ev.obs().grad_hidden is not None
    assert ev.expected.grad is None and ev.expected.grad_hidden is not None
    ev = _evidence(LinearCase(tp=1, T=6, H=8, v_local=5, frozen="hidden", seed=1))
    assert ev.obs().grad is not None and ev.obs().grad_hidden is None


# ------------------------------------------------------------------ one allowance for every memory check

def test_allowance_is_one_source():
    t = WrapperCase(tp=1, v_local=7, total_lengths=(4,), response_lengths=(0,), chunk_size=1, with_entropy=False,
                    layout="transposed")
    assert allowance(t, "peak_forward") == memory_meter.unit(t.T, t.v_local)
    assert allowance(t.replace(layout="contiguous"), "peak_forward") == 0
    lin = LinearCase(tp=1, T=4, H=64, v_local=32)
    asked, frozen = allowance(lin, "peak_backward"), allowance(lin.replace(frozen="weight"), "peak_backward")
    assert asked - frozen == 12 * 32 * 64  # the weight's float32 accumulator, a product, the float32 result
    assert allowance(lin, "retained") == 0 and allowance(lin.replace(dtype="bf16"), "retained") == 4 * 64 * (4 + 32)
    assert budget_use(t, memory_meter.budget_slack(t.T) + allowance(t, "retained"), "retained") == 0


def test_wrapper_copy_of_transposed_logits_is_not_a_finding():
    """A false finding the harness must not make, from the corpus: a wrapper that makes transposed logits contiguous."""
    entry = next(e for e in CORPUS if e.name == "wrapper-transposed-contiguous-copy")
    ev = _evidence(entry.case, "tests.targets.contiguous_wrapper")
    chk = all_checks()["memory-chunk-passthrough"]
    assert chk.applicable(entry.case, ev.target) and chk.fn(ev) == []


# ------------------------------------------------------------------ deep accumulation, sized from numbers

def test_low_precision_sum_grows_past_the_bound_with_the_chunks():
    spec = importlib.util.spec_from_file_location("deep_accumulation", SCRIPT)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    case = LinearCase(tp=1, T=8, H=8, v_local=16, dtype="bf16", regime=DRIFT, chunk_size=1, with_entropy=False,
                      seed=244)
    shallow = study.ratio(case, "bf16")
    deep = study.ratio(case.replace(T=256), "bf16")
    assert shallow < 1 < 2 < deep and study.ratio(case.replace(T=256), None) < 0.5


# ------------------------------------------------------------------ the mutants die in the ci profile

@pytest.mark.distributed
def test_new_mutants_killed_by_their_checks(harness_pools):
    results = run_catalog(list(NEW_MUTANTS), [1, 2, 4], harness_pools, budget=30, collective_timeout_s=6,
                          include_clean=False)
    survivors = [r.name for r in results if r.name != CLEAN and not r.ok]
    assert not survivors, kill_matrix(results)
