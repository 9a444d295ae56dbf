"""Cases the way real callers make them (layouts, token layouts, call contexts), the not-applied
notes, and the opt-in bitwise family (docs/callers.md, docs/bitwise.md).

Most tests run one rank in-process (TP 1, no process group): the executor and the checks are the
same code the pools run. The CLI test at the end runs on the session's pools.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings

from harness.cases.case import CONTEXTS, LAYOUTS, TOKEN_LAYOUTS, KernelCase, WrapperCase, parse_case
from harness.cases.strategies import kernel_cases, wrapper_cases
from harness.checks import Evidence, all_checks, bitwise_diff
from harness.engine.calls import laid_out, tokens_laid_out, view_of
from harness.engine.executor import run_on_rank
from harness.targets import load_target

CPU = torch.device("cpu")
FUSED = "harness.targets.fused"


def _evidence(case, target_spec: str = FUSED) -> Evidence:
    target = load_target(target_spec)
    return Evidence(case, target, [run_on_rank(case, target, 0, CPU)])


def _problems(case, check: str, target_spec: str = FUSED, twin=None) -> list[str]:
    ev = _evidence(case, target_spec)
    chk = all_checks(bitwise=True)[check]
    assert chk.applicable(case, ev.target), f"{check} does not apply to {case.spec()}"
    if chk.twin is not None:
        ev.twins[check] = _evidence(twin or chk.twin(case), target_spec)
    return chk.fn(ev)


# ------------------------------------------------------------------ the case fields

def test_new_fields_leave_earlier_specs_unchanged():
    old = ("kernel:tp=2,T=3,v_local=4,dtype=fp32,regime=normal,chunk_size=-1,mask=none,with_entropy=1,"
           "with_entropy_grad=1,requires_grad=1,loss_terms=both,seed=0")
    assert KernelCase(tp=2, T=3, v_local=4).spec() == old and parse_case(old) == KernelCase(tp=2, T=3, v_local=4)
    c = KernelCase(tp=2, T=3, v_local=4, layout="transposed", token_layout="offset", context="no_grad", repeat=1)
    assert parse_case(c.spec()) == c and "context=no_grad" in c.spec()
    w = WrapperCase(tp=1, v_local=3, total_lengths=(3,), response_lengths=(1,), context="two_calls", layout="offset")
    assert parse_case(w.spec()) == w


@settings(max_examples=40, deadline=None)
@given(kernel_cases())
def test_kernel_specs_round_trip(case):
    assert parse_case(case.spec()) == case


@settings(max_examples=20, deadline=None)
@given(wrapper_cases())
def test_wrapper_specs_round_trip(case):
    assert parse_case(case.spec()) == case


def test_contexts_keep_the_first_call_inputs_and_add_second_weights():
    base = KernelCase(tp=2, T=5, v_local=3, seed=7).inputs()
    for context in CONTEXTS:
        inp = KernelCase(tp=2, T=5, v_local=3, seed=7, context=context).inputs()
        assert torch.equal(inp.logits, base.logits) and torch.equal(inp.w_log_prob, base.w_log_prob)
        assert (inp.w_log_prob_2 is not None) == (context in ("accumulate", "two_calls"))


def test_rows_of_batch_are_slices_of_the_batch():
    case = KernelCase(tp=2, T=7, v_local=3, mask="random", regime="neginf", context="accumulate", seed=3)
    full = case.inputs()
    part = case.rows_of_batch(2, 3)
    assert part.T == 3 and part.batch_of == 7 and part.row_start == 2
    sub = part.inputs()
    for f in dataclasses.fields(full):
        a, b = getattr(full, f.name), getattr(sub, f.name)
        assert torch.equal(a[2:5], b), f.name


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_keep_values_and_change_memory(layout):
    t = torch.randn(5, 4)
    source, logits = laid_out(t.clone(), layout, True)
    assert torch.equal(logits.detach(), t) and source.is_leaf and source.requires_grad
    if layout in ("transposed", "row_strided", "col_strided"):
        assert not logits.is_contiguous()
    if layout == "offset":
        assert logits.storage_offset() > 0
    assert (logits.grad_fn is not None) == (layout != "contiguous")  # a view or an op's output
    logits.sum().backward()
    assert torch.equal(view_of(source.grad, layout if layout != "nonleaf" else ""), torch.ones(5, 4))


@pytest.mark.parametrize("layout", TOKEN_LAYOUTS)
def test_token_layouts_are_int64_views(layout):
    tokens = torch.arange(6)
    out = tokens_laid_out(tokens, layout)
    assert out.dtype == torch.int64 and torch.equal(out, tokens)
    assert (out._base is not None) == (layout != "contiguous")


def test_strategies_draw_every_layout_and_context():
    seen = {"layout": set(), "token_layout": set(), "context": set()}

    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(kernel_cases())
    def draw(case):
        for k in seen:
            seen[k].add(getattr(case, k))

    draw()
    assert seen == {"layout": set(LAYOUTS), "token_layout": set(TOKEN_LAYOUTS), "context": set(CONTEXTS)}


# ------------------------------------------------------------------ every check applies, or says why not

def _default_checks_pass(case) -> None:
    ev = _evidence(case)
    assert not ev.failed_ranks, ev.ranks[0].error
    for name, chk in all_checks().items():
        if chk.twin is None and chk.applicable(case, ev.target):
            assert chk.fn(ev) == [], f"{name} on {case.spec()}"


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_builtin_passes_in_every_layout_and_context(layout, context):
    for mask in ("none", "random"):
        _default_checks_pass(KernelCase(tp=1, T=6, v_local=5, chunk_size=4, mask=mask, layout=layout,
                                        token_layout="strided", context=context, seed=11))


@pytest.mark.parametrize("context", CONTEXTS)
def test_builtin_wrapper_passes_in_every_context(context):
    for layout in ("contiguous", "transposed", "nonleaf"):
        _default_checks_pass(WrapperCase(tp=1, v_local=5, total_lengths=(5, 4), response_lengths=(3, 2),
                                         entropy_coef=0.01, temperature=0.7, top_p="nucleus", layout=layout,
                                         token_layout="offset", context=context, seed=5))


def test_no_grad_gives_notes_not_silence():
    chk = all_checks()["gradients"]
    target = load_target(FUSED)
    case = KernelCase(tp=1, T=4, v_local=3, context="no_grad")
    assert not chk.applicable(case, target)
    assert chk.not_applied(case, target).startswith("not applied: no_grad: autograd is off")
    # A case the check would not apply to anyway gets no note.
    assert chk.not_applied(case.replace(requires_grad=False), target) is None
    assert all_checks()["values"].not_applied(case, target) is None  # values apply under no_grad
    assert all_checks()["memory-budget"].not_applied(case.replace(context="two_calls"), target)


def test_grad_flags_expect_no_graph_under_no_grad():
    for context in ("no_grad", "inference_mode"):
        ev = _evidence(KernelCase(tp=1, T=3, v_local=4, context=context))
        assert ev.obs().log_prob_meta.requires_grad is False and ev.obs().training is not None
        assert all_checks()["grad-flags"].fn(ev) == []


def test_two_calls_sum_the_gradients():
    case = KernelCase(tp=1, T=5, v_local=4, context="two_calls", seed=2)
    ev = _evidence(case)
    single = _evidence(case.replace(context="train"))
    assert not torch.allclose(ev.full_grad(), single.full_grad())  # the second call's term is there
    assert all_checks()["gradients"].fn(ev) == []


# ------------------------------------------------------------------ mutants of the new families

def test_row_major_reader_is_caught_on_a_transposed_view():
    case = KernelCase(tp=1, T=5, v_local=6, layout="transposed", seed=1)
    assert _problems(case, "values", "mutant:reads-as-row-major")
    assert not _problems(case.replace(layout="offset"), "values", "mutant:reads-as-row-major")


def test_inference_path_without_keep_mask_is_caught():
    case = KernelCase(tp=1, T=5, v_local=6, mask="random", context="no_grad", seed=1)
    problems = _problems(case, "inference-path", "mutant:inference-drops-keep-mask")
    assert problems and "differ in their bits" in problems[0]
    assert not _problems(case, "inference-path")


def test_overwritten_gradient_buffer_is_caught_by_two_calls():
    case = KernelCase(tp=1, T=5, v_local=6, context="two_calls", seed=1)
    assert _problems(case, "gradients", "mutant:grad-buffer-overwritten")
    assert not _problems(case.replace(context="train"), "gradients", "mutant:grad-buffer-overwritten")


def test_reduction_order_per_call_fails_determinism():
    case = KernelCase(tp=1, T=6, v_local=13, seed=4)
    assert _problems(case, "determinism", "mutant:reduction-order-per-call")
    assert not _problems(case, "determinism")


def test_reduction_order_by_rows_fails_batch_invariance():
    case = KernelCase(tp=1, T=8, v_local=13, seed=4)
    assert _problems(case, "batch-invariance-packing", "mutant:reduction-order-by-rows")
    assert not _problems(case, "batch-invariance-packing")
    assert not _problems(case, "batch-invariance-rows")


def test_bitwise_diff_sees_signed_zero_and_lists():
    assert bitwise_diff(torch.tensor([0.0]), torch.tensor([-0.0]), "x")
    assert not bitwise_diff([torch.tensor([1.0])], [torch.tensor([1.0])], "x")
    assert bitwise_diff([torch.tensor([1.0])], None, "x")


def test_bitwise_family_is_opt_in():
    default, every = all_checks(), all_checks(bitwise=True)
    bitwise = set(every) - set(default)
    assert bitwise == {"determinism", "batch-invariance-chunk", "batch-invariance-rows", "batch-invariance-packing"}
    assert all(every[n].family == "bitwise" for n in bitwise)


# ------------------------------------------------------------------ the CLI

@pytest.mark.distributed
def test_cli_bitwise_prints_the_property_sheet_and_notes(tmp_path, capsys, harness_pools):
    from harness.cli import main

    out = tmp_path / "r.json"
    rc = main(["check", "--profile", "smoke", "--tp", "1,2", "--bitwise", "-q", "--json", str(out)], pools=harness_pools)
    stdout = capsys.readouterr().out
    assert "bitwise properties" in stdout and "holds" in stdout and "TP invariance is not" in stdout
    assert "not applied:" in stdout
    data = json.loads(out.read_text())
    # The built-in routine is deterministic, and batch-invariant at TP 1 and 2 except on transposed
    # logits, where PyTorch's CPU sum over a strided dimension depends on the row count (docs/bitwise.md).
    assert all(c["determinism"]["checked"] == c["determinism"]["held"] for c in data["bitwise"].values())
    assert rc == (1 if data["findings"] else 0)
    for f in data["findings"]:
        assert f["check"].startswith("batch-invariance") and "layout=transposed" in f["case"], f
    assert any(lv.get("not_applied") for c in data["checks"].values() for lv in c.values())
    from harness.report import render

    md = render.render_markdown(data)
    assert "Bitwise properties" in md and "Not applied in some call contexts" in md
