"""Memory meters and checks (docs/memory.md): the meters are exact on hand-made calls, the memory
defects are caught where they cost memory and only there, correct routines of three designs get
no memory finding, and the built-in routine keeps its declared budget."""
from __future__ import annotations

import math
import weakref
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.cases.case import DistillCase, KernelCase, WrapperCase
from harness.cases.corpus import CORPUS
from harness.cases.strategies import kernel_cases, linear_cases, wrapper_cases
from harness.checks import all_checks
from harness.checks import memory as memory_checks
from harness.driver.runner import Runner
from harness.engine.observations import TensorMeta
from harness.meters import memory_meter
from harness.targets.mutants import catalog

CPU = torch.device("cpu")
MEMORY_CHECKS = {name for name in all_checks() if name.startswith("memory-")}
T, V = 8, 32
TV4 = T * V * 4


LEDGERS = [memory_meter.ModeLedger] + ([memory_meter.compiled_ledger()] if memory_meter.compiled_ledger() else [])


@pytest.fixture(params=LEDGERS, ids=lambda ledger: "compiled" if ledger is not memory_meter.ModeLedger else "mode")
def ledger(request) -> type:
    """Each test by hand runs on both ledgers: the C++ one and the dispatch mode it is held to."""
    return request.param


def _meter(ledger: type, *inputs: torch.Tensor) -> memory_meter.Meter:
    return memory_meter.Meter(inputs, CPU, ledger=ledger)


# ---------------------------------------------------------------------------- meters, by hand
class _StashOnCtx(torch.autograd.Function):
    """Keeps a [T, V] buffer as a ctx attribute: no saved-tensor hook ever sees it."""

    @staticmethod
    def forward(ctx, x):
        ctx.buf = torch.empty(T, V)
        return x.sum(-1)

    @staticmethod
    def backward(ctx, g):
        return g.unsqueeze(-1).expand(T, V).clone()


class _SaveTwoViews(torch.autograd.Function):
    """Saves two views of one new [T, V] buffer, and the caller's input."""

    @staticmethod
    def forward(ctx, x):
        buf = x * 2
        ctx.save_for_backward(x, buf[: T // 2], buf[T // 2:])
        return x.sum(-1)

    @staticmethod
    def backward(ctx, g):
        _x, a, b = ctx.saved_tensors
        return g.unsqueeze(-1) * torch.cat([a, b])


class _SaveOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


def test_ctx_attribute_cannot_hide(ledger):
    x = torch.randn(T, V, requires_grad=True)
    meter = _meter(ledger, x)
    with meter.forward():
        y = _StashOnCtx.apply(x)
    meter.outputs(y)
    f = meter.figures
    assert f["retained"] == TV4 + T * 4  # the stash and the [T] output; the input is the caller's
    assert f["saved"] == 0
    assert {"shape": [T, V], "dtype": "float32", "bytes": TV4, "how": "alive", "op": "empty"} in f["retained_tensors"]
    loss = y.sum()
    with meter.backward():
        loss.backward()
    # ctx lives as long as y's graph: the stash outlives the backward.
    assert meter.figures["leftover"] == TV4
    # retained + the engine's scalar seed + the gradient (AccumulateGrad keeps it without a copy)
    assert meter.figures["peak_backward"] == TV4 + T * 4 + 4 + TV4


def test_saved_views_count_their_storage_once_and_backward_frees_them(ledger):
    x = torch.randn(T, V, requires_grad=True)
    meter = _meter(ledger, x)
    with meter.forward():
        y = _SaveTwoViews.apply(x)
    meter.outputs(y)
    assert meter.figures["retained"] == TV4 + T * 4
    assert meter.figures["saved"] == TV4
    with meter.backward():
        y.sum().backward()
    assert meter.figures["leftover"] == 0


class _GradFromSaved(torch.autograd.Function):
    """Saves its softmax and turns that very buffer into the returned gradient, in place: the
    allocation a slime-style backward saves. The buffer is then the caller's `.grad`, not a leak."""

    @staticmethod
    def forward(ctx, x):
        p = torch.softmax(x, dim=-1)
        ctx.save_for_backward(p)
        return torch.logsumexp(x, dim=-1)

    @staticmethod
    def backward(ctx, g):
        (p,) = ctx.saved_tensors
        return p.mul_(g.unsqueeze(-1))  # d lse / dx = softmax, scaled in place


def test_a_saved_buffer_returned_as_the_gradient_is_not_leftover(ledger):
    x = torch.randn(T, V, requires_grad=True)
    meter = _meter(ledger, x)
    with meter.forward():
        y = _GradFromSaved.apply(x)
    meter.outputs(y)
    with meter.backward():
        y.sum().backward()
    assert meter.figures["leftover"] == TV4  # alive after backward: as the gradient, it turns out
    meter.gradients(x.grad)
    assert meter.figures["leftover"] == 0 and meter.figures["leftover_tensors"] == []
    assert torch.allclose(x.grad, torch.softmax(x.detach(), -1))


def test_peak_is_exact_and_inputs_never_count(ledger):
    x = torch.zeros(10_000, dtype=torch.uint8)
    meter = _meter(ledger, x)
    with meter.forward():
        a = torch.empty(1000, dtype=torch.uint8)
        b = torch.empty(2000, dtype=torch.uint8)
        x.add_(1)  # in place on the caller's tensor: no allocation
        del a
        c = b[:500].clone()
        del b
    meter.outputs(c)
    assert meter.figures["peak_forward"] == 3000
    assert meter.figures["retained"] == 500


def test_views_cost_nothing_and_copying_composites_count(ledger):
    """Views pass the meter by (their schema says they alias); but under inference_mode the
    composites that return a view *or a copy* (contiguous, reshape) reach the meter undecomposed,
    and a copy they make must count like any other allocation."""
    x = torch.randn(13, 7)
    row = 13 * 7 * 4
    for mode in (torch.enable_grad, torch.inference_mode):
        meter = _meter(ledger, x)
        with mode(), meter.forward():
            views = [x.t(), x[2:5], x.unsqueeze(0), x.view(91), x.reshape(7, 13), x.contiguous()]
            copies = [x.t().contiguous(), x.t().reshape(91)]
        meter.outputs(*views, *copies)
        assert meter.figures["retained"] == 2 * row, mode
        assert sorted(t["op"] for t in meter.figures["retained_tensors"]) in (
            ["clone", "clone"], ["contiguous", "reshape"]), mode


def test_measuring_keeps_autograds_inplace_error(ledger):
    """With saved-tensor hooks autograd skips its version check; the meter makes it itself."""
    for metered in (False, True):
        x = torch.randn(4, requires_grad=True)
        meter = _meter(ledger, x)
        with meter.forward() if metered else torch.enable_grad():
            y = _SaveOutput.apply(x)
        y.detach().add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_measuring_leaks_nothing(ledger):
    """A saved output must not become a reference cycle through the hooks."""
    x = torch.randn(4, requires_grad=True)
    freed = []
    with _meter(ledger, x).forward():
        y = _SaveOutput.apply(x)
    ref = weakref.ref(y.untyped_storage(), lambda _: freed.append(1))
    del y
    assert freed and ref() is None


# ---------------------------------------------------------------------------- through the pools
def _findings(runner: Runner, case) -> dict[str, str]:
    _, findings = runner.check(case, only=MEMORY_CHECKS)
    return {f.check: f.message for f in findings}


MUTANTS = ("metric-only-entropy-retained", "metric-only-graph-detached", "ctx-outlives-backward",
           "forward-buffers-kept", "chunk-size-ignored", "chunked-grad-buffer-float32", "wrapper-logits-float32",
           "distill-logits-float32-before-chunks", "caller-chunk-size-dropped")


def test_memory_mutants_are_in_the_catalog():
    cat = catalog()
    for name in MUTANTS:
        assert set(cat[name].expected) & MEMORY_CHECKS


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_metric_only_retention_caught_where_it_costs(harness_pools, tp):
    runner = Runner("mutant:metric-only-entropy-retained", pools=harness_pools)
    for dtype, mask, costs in (("fp32", "none", False), ("fp32", "random", True),
                               ("bf16", "none", True), ("bf16", "random", True)):
        case = KernelCase(tp=tp, T=16, v_local=64, dtype=dtype, mask=mask, with_entropy=True,
                          with_entropy_grad=False, seed=7)
        found = _findings(runner, case)
        # float32 unmasked: the upcast is the caller's tensor and the saved softmax already is the
        # entropy's, so the stash costs nothing and nothing is reported.
        assert ("memory-metric-only" in found) == costs, (dtype, mask, found)
        assert ("memory-backward-frees" in found) == costs, (dtype, mask, found)
        if costs:
            assert "float32[16, 64] 4,096 B (alive" in found["memory-metric-only"]
    wrapper = WrapperCase(tp=tp, v_local=64, total_lengths=(12, 10), response_lengths=(5, 4), entropy_coef=0.0,
                          seed=3)
    assert "memory-coef-zero" not in _findings(runner, wrapper)  # float32, unmasked: free
    assert "memory-coef-zero" in _findings(runner, wrapper.replace(top_p="nucleus"))


@pytest.mark.distributed
def test_detached_graph_caught_where_the_kernel_input_is_a_copy(harness_pools):
    """Building the entropy's graph and detaching the output keeps the kernel's input alive: the
    caller's own logits (free), or the wrapper's temperature-scaled copy."""
    runner = Runner("mutant:metric-only-graph-detached", pools=harness_pools)
    case = WrapperCase(tp=2, v_local=64, total_lengths=(12, 10), response_lengths=(5, 4), entropy_coef=0.0, seed=3)
    assert "memory-coef-zero" not in _findings(runner, case)
    assert "float32[22, 64]" in _findings(runner, case.replace(temperature=0.7)).get("memory-coef-zero", "")


@pytest.mark.distributed
def test_buffers_outliving_backward_and_budget_caught(harness_pools):
    case = KernelCase(tp=2, T=16, v_local=64, with_entropy=False, seed=2)
    assert "memory-backward-frees" in _findings(Runner("mutant:ctx-outlives-backward", pools=harness_pools), case)
    found = _findings(Runner("mutant:forward-buffers-kept", pools=harness_pools), case)
    assert "retained" in found.get("memory-budget", ""), found
    assert "memory-metric-only" not in found  # the same bytes in every mode: only a budget sees them


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_ignored_chunk_size_caught(harness_pools, tp):
    case = WrapperCase(tp=tp, v_local=64, total_lengths=(24, 16), response_lengths=(12, 8), chunk_size=4,
                       entropy_coef=0.5, seed=5)
    found = _findings(Runner("mutant:chunk-size-ignored", pools=harness_pools), case)
    assert "log_probs_chunk_size ignored" in found.get("memory-chunk-passthrough", ""), found
    assert not _findings(Runner("harness.targets.fused", pools=harness_pools), case)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_a_caller_s_dropped_chunk_size_caught_with_no_kernel_to_compare(harness_pools, tp):
    """A wrapper-only target, as a trainer's loss-side caller is: its memory against its own unchunked
    call's (`memory-chunk-effect`), and its float32 work held to chunks whether or not it is seen to
    chunk (`memory-logits-dtype` at the wrapper, a level configured with a chunk size). The built-in
    routine, which uses the size, passes both, in float32 and in bf16."""
    case = WrapperCase(tp=tp, v_local=64, total_lengths=(9, 7), response_lengths=(4, 3), chunk_size=4,
                       with_entropy=False, dtype="bf16", seed=2871)
    dropped = Runner("mutant:caller-chunk-size-dropped", pools=harness_pools)
    assert dropped.target.kernel is None
    found = _findings(dropped, case)
    assert "the configured chunk size did not reach the work on the logits" in found.get("memory-chunk-effect", ""), found
    assert "its forward holds no chunk of 4 rows" in found.get("memory-logits-dtype", ""), found
    assert "memory-chunk-effect" in _findings(dropped, case.replace(dtype="fp32"))
    builtin = Runner("harness.targets.fused", pools=harness_pools)
    assert not _findings(builtin, case) and not _findings(builtin, case.replace(dtype="fp32"))


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_float32_copies_of_half_precision_logits_caught(harness_pools, tp):
    """NeMo-RL #2872's two defects, each where it costs: a chunked backward's float32 gradient buffer
    of the whole bf16 logits, and the whole logits cast to float32 in front of the chunked kernel
    (in the forward when nothing saves the copy, in the backward always: the kernel then returns its
    gradient in float32). With float32 logits neither costs anything, and the check does not apply."""
    kernel = KernelCase(tp=tp, T=16, v_local=64, dtype="bf16", chunk_size=4, with_entropy=False, seed=2872)
    wrapper = WrapperCase(tp=tp, v_local=64, total_lengths=(6, 4), response_lengths=(3, 2), chunk_size=2,
                          entropy_coef=0.01, dtype="bf16", seed=2153)
    clean = Runner("harness.targets.fused", pools=harness_pools)
    assert not _findings(clean, kernel) and not _findings(clean, wrapper)
    buffer = Runner("mutant:chunked-grad-buffer-float32", pools=harness_pools)
    found = _findings(buffer, kernel).get("memory-logits-dtype", "")
    assert "the backward's peak" in found and "float32[16, 64] 4,096 B (alive, from empty)" in found, found
    cast = Runner("mutant:wrapper-logits-float32", pools=harness_pools)
    assert "the backward's peak" in _findings(cast, wrapper).get("memory-logits-dtype", "")
    found = _findings(cast, wrapper.replace(context="no_grad")).get("memory-logits-dtype", "")
    assert "the forward's peak" in found and "float32[1, 10, 64] 2,560 B (alive, from _to_copy)" in found, found
    check = all_checks()["memory-logits-dtype"]
    for runner, case in ((buffer, kernel.replace(dtype="fp32")), (cast, wrapper.replace(dtype="fp32"))):
        assert not check.applicable(case, runner.target) and not _findings(runner, case)


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_whole_logits_upcast_in_front_of_distillation_chunks_caught(harness_pools, tp):
    """The distillation level: the whole student (and teacher) logits cast to float32 in front of the
    chunked top-k or divergence is a float32 copy at the forward's peak. The built-in routine passes
    the same cases: it upcasts a chunk at a time and builds the gradients in the logits' dtype (the
    log-softmax's float32 output has the caller's float32 gradient, which is granted)."""
    small = dict(tp=tp, T=16, v_local=64, chunk_size=4, seed=50)
    cases = (DistillCase(function="topk", k=3, requires_grad=False, dtype="bf16", **small),
             DistillCase(kind="jsd", k=0, teacher_grad=True, dtype="bf16", **small),
             DistillCase(function="log_softmax", dtype="fp16", **small))
    clean = Runner("harness.targets.fused", pools=harness_pools)
    upcast = Runner("mutant:distill-logits-float32-before-chunks", pools=harness_pools)
    for case in cases:
        assert not _findings(clean, case), case.spec()
        found = _findings(upcast, case).get("memory-logits-dtype", "")
        assert "the forward's peak" in found and "float32[16, 64] 4,096 B (alive, from _to_copy)" in found, found


def _figures(*tensors: tuple, peak_backward: tuple = (), retained: tuple = ()) -> dict:
    """One rank's memory figures, by hand: (shape, dtype, how, op) per listed tensor."""
    size = {"float32": 4, "bfloat16": 2, "int64": 8}
    describe = lambda ts: [{"shape": list(s), "dtype": d, "bytes": size[d] * math.prod(s), "how": h, "op": o}  # noqa: E731
                           for s, d, h, o in ts]
    return {"peak_forward": 1, "peak_forward_tensors": describe(tensors), "retained_tensors": describe(retained),
            "peak_backward": 1 if peak_backward else None, "peak_backward_tensors": describe(peak_backward)}


def _judge(case, figures: dict, output: TensorMeta | None = None) -> list[str]:
    rank = SimpleNamespace(name="rank 0", obs=SimpleNamespace(memory=figures, log_prob_meta=output, entropy_meta=None))
    return memory_checks.logits_dtype(SimpleNamespace(case=case, ranks=[rank]))  # type: ignore[arg-type]


def test_what_memory_no_vocab_gather_judges():
    """By hand: a chunk's rows over the whole vocabulary is a gather; a vector over the rows as long as
    V (alone, or stacked for student and teacher) and the caller's own buffer of a col-strided view
    (its gradient, from the view's backward) are not."""
    from harness.checks.distill import no_vocab_gather

    def judge(case, *tensors):
        rank = SimpleNamespace(name="rank 0", obs=SimpleNamespace(memory=_figures(*tensors)))
        return no_vocab_gather(SimpleNamespace(case=case, ranks=[rank]))  # type: ignore[arg-type]

    case = DistillCase(tp=2, T=30, v_local=13, function="divergence", chunk_size=4)
    assert "float32[4, 26]" in judge(case, ((4, 26), "float32", "alive", "cat"))[0]
    assert judge(case, ((30,), "float32", "alive", "sum")) == []  # the per-token divergence, T >= V
    assert judge(case, ((2, 30), "float32", "alive", "stack")) == []  # student's and teacher's normalisers
    one_row = case.replace(chunk_size=1)
    assert judge(one_row, ((30,), "float32", "alive", "sum"), ((2, 1), "float32", "alive", "stack")) == []
    strided = case.replace(T=3, layout="col_strided")
    assert judge(strided, ((3, 26), "float32", "alive", "slice_backward")) == []  # the caller's [T, 2 V_local]
    assert "float32[3, 26]" in judge(strided.replace(layout="contiguous"), ((3, 26), "float32", "alive", "cat"))[0]


def test_what_memory_logits_dtype_judges():
    """By hand: only float32 copies of the whole logits that the forward frees, and whole float32
    buffers that the backward allocates, in a routine seen to work in chunks."""
    case = KernelCase(tp=2, T=16, v_local=64, dtype="bf16", chunk_size=4)
    chunk = ((4, 64), "float32", "alive", "_to_copy")
    copy = ((16, 64), "float32", "alive", "_to_copy")
    saved = ((16, 64), "float32", "saved", "empty")
    assert "float32[16, 64] 4,096 B (alive, from _to_copy)" in _judge(case, _figures(copy, chunk))[0]
    assert _judge(case, _figures(copy, chunk, retained=(copy,))) == []  # kept (on ctx): the budget's
    assert _judge(case, _figures(saved, chunk, retained=(saved,))) == []  # saved for backward
    assert _judge(case, _figures(copy)) == []  # every row at once: not a chunked routine
    gathered = ((4, 256), "float32", "alive", "cat")  # a chunk's rows over the full vocab: 1,024 entries
    assert _judge(case, _figures(gathered, chunk)) == []
    grad = ((16, 64), "float32", "alive", "zeros_like")
    found = _judge(case, _figures(saved, chunk, retained=(saved,), peak_backward=(saved, grad)))
    assert len(found) == 1 and "float32[16, 64] 4,096 B (alive, from zeros_like)" in found[0]
    in_dtype = ((16, 64), "bfloat16", "alive", "empty")
    assert _judge(case, _figures(saved, chunk, retained=(saved,), peak_backward=(saved, in_dtype, chunk))) == []
    pieces = [((1, 64), "float32", "alive", "sub")] * 20  # each chunk's gradient kept: the whole buffer in pieces
    assert _judge(case.replace(T=40, chunk_size=1), _figures(((1, 64), "float32", "alive", "_to_copy"),
                                                             peak_backward=tuple(pieces))) == []  # 20 < 16 x TP 2
    assert "chunks of [1, 64]" in _judge(case.replace(tp=1, T=40, chunk_size=1, v_local=64),
                                         _figures(((1, 64), "float32", "alive", "_to_copy"),
                                                  peak_backward=tuple(pieces)))[0]
    # Top-k log-probs stacked for student and teacher, [2, chunk_size, K] and [2, T, K], whose sizes
    # equal T or V_local: not the logits, which are laid out [T, V_local]
    for rows, chunk_size, stack in ((8, 5, (2, 5, 8)), (8, 5, (2, 8, 8)), (2, 1, (2, 1, 8))):
        small = case.replace(T=rows, v_local=8, chunk_size=chunk_size)
        chunk8 = ((chunk_size, 8), "float32", "alive", "_to_copy")
        assert _judge(small, _figures((stack, "float32", "alive", "stack"), chunk8)) == [], stack
        assert _judge(small, _figures(((rows, 8), "float32", "alive", "_to_copy"), chunk8)) != []
    # A float32 output of the logits' shape (the sharded log-softmax): the caller's loss holds two
    # float32 gradients of it at once; a third whole buffer is the routine's.
    output = TensorMeta((16, 64), "float32", True)
    upstream = ((16, 64), "float32", "alive", "mul")
    assert _judge(case, _figures(chunk, peak_backward=(upstream, upstream, chunk)), output) == []
    assert "from mul" in _judge(case, _figures(chunk, peak_backward=(upstream, upstream, chunk)))[0]
    found = _judge(case, _figures(chunk, peak_backward=(upstream, upstream, grad)), output)
    assert len(found) == 1 and "float32[16, 64] 4,096 B (alive, from zeros_like)" in found[0]


@pytest.mark.distributed
def test_declared_budget_is_enforced(harness_pools):
    case = KernelCase(tp=1, T=16, v_local=64, seed=1)  # differentiable entropy
    found = _findings(Runner("tests.targets.naive_budget", pools=harness_pools), case)
    assert "retained" in found.get("memory-budget", ""), found
    assert "memory-budget" not in _findings(Runner("harness.targets.fused", pools=harness_pools), case)


def _wide(strategy):
    """Random cases with a vocab shard 8x wider: a [T, V_local] tensor then stands out of O(T)."""
    return strategy.map(lambda c: c.replace(v_local=c.v_local * 8))


@pytest.mark.distributed
@pytest.mark.parametrize("spec", ["harness.targets.fused", "harness.targets.naive", "tests.targets.recompute"])
def test_correct_designs_get_no_memory_finding(harness_pools, spec):
    runner = Runner(spec, pools=harness_pools)
    tp = st.sampled_from((1, 2))
    linear = "linear" in runner.target.levels
    for strategy in (kernel_cases(tp=tp), wrapper_cases(tp=tp), *((linear_cases(tp=tp),) if linear else ())):
        @settings(max_examples=40, derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(_wide(strategy))
        def run(case):
            found = _findings(runner, case)
            assert not found, f"{case.spec()}: {found}"

        run()
    applied = {name for (name, _), s in runner.verdicts.stats.items() if s.applied}
    unused = ({"memory-budget"} if spec != "harness.targets.fused" else set()) \
        | (set() if linear else {"memory-linear-retained"})  # a level the target does not provide
    unused |= {n for n in MEMORY_CHECKS if all_checks()[n].levels == ("distill",)}  # a level this test does not draw
    if not runner.target.supports("chunk_size"):  # its wrapper's cases run unchunked: nothing to hold it to
        unused |= {"memory-chunk-effect", "memory-chunk-passthrough"}
    assert applied >= MEMORY_CHECKS - unused


@pytest.mark.distributed
def test_figures_are_deterministic_at_tp2(harness_pools):
    """A collective's work object lets go of its tensors on a backend thread; the meter must not
    depend on when (the naive routine drops its gathered shards right after the collective)."""
    case = WrapperCase(tp=2, v_local=48, total_lengths=(9, 7), response_lengths=(4, 3), chunk_size=3,
                       entropy_coef=0.5, seed=11)
    pool = Runner("harness.targets.naive", pools=harness_pools).pool(2)
    runs = [pool.run("tests.pool_jobs:memory_figures", case, "harness.targets.naive") for _ in range(5)]
    assert all(r == runs[0] for r in runs), runs
    assert set(runs[0][0]) >= {"retained_bytes", "peak_forward_bytes", "peak_backward_bytes"}


@pytest.mark.distributed
def test_recorded_nucleus_is_granted_its_own_size(harness_runner, monkeypatch):
    """The nucleus ids are an input of up to T*V entries: at TP 4 their int64 copies alone pass the
    built-in's budget in units of T*V_local. Granted per entry, the corpus case passes; without
    that grant it is the false finding the thorough profile reported at TP 8."""
    case = next(e for e in CORPUS if e.name == "wrapper-top-p-nucleus-copies").case
    assert memory_checks.nucleus_entries(case) > 2 * case.T * case.v_local  # twice as many ids as T*V_local
    assert harness_runner.check(case, only={"memory-budget"})[1] == []
    monkeypatch.setattr(memory_checks, "NUCLEUS_ENTRY_BYTES", 0)
    assert [f.check for f in harness_runner.check(case, only={"memory-budget"})[1]] == ["memory-budget"]


@pytest.mark.distributed
@pytest.mark.skipif(memory_meter.compiled_ledger() is None, reason="the C++ ledger cannot be built here (no compiler)")
@pytest.mark.parametrize("strategy", [kernel_cases, wrapper_cases, linear_cases], ids=["kernel", "wrapper", "linear"])
def test_the_compiled_ledger_counts_what_the_dispatch_mode_counts(harness_pools, strategy):
    """Every figure of every rank, by the C++ ledger and by the dispatch mode, on drawn cases of
    the built-in routine at TP 2 (tests/test_ledger_parity.py, a slow test, runs the same comparison at scale)."""
    runner = Runner("harness.targets.fused", pools=harness_pools)

    @settings(max_examples=6, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy(tp=st.just(2)))
    def compare(case):
        for figures in runner.pool(2).run("tests.pool_jobs:both_ledgers", case, "harness.targets.fused"):
            mode, compiled = figures["mode"], figures["compiled"]
            assert mode["memory"] and mode["error"] is None
            for where in ("memory", "kernel_pass"):
                strip = _scalars if where == "memory" else lambda passes: {k: _scalars(v) for k, v in passes.items()}
                assert strip(compiled[where]) == strip(mode[where]), case

    compare()


def _scalars(figures: dict) -> dict:
    return {k: v for k, v in figures.items() if not k.endswith("_tensors")}


@pytest.mark.distributed
@pytest.mark.skipif(memory_meter.compiled_ledger() is None, reason="the C++ ledger cannot be built here (no compiler)")
def test_a_collective_behind_the_ledgers_back_leaves_the_call_unmeasured_and_the_mode_after(harness_pools):
    """A routine that hands a ProcessGroup a counted storage directly: the work object's hold on it
    could race the figures, so that call has none, and the rank's later meters use the dispatch
    mode, which aliases at the op."""
    pool = Runner("harness.targets.fused", pools=harness_pools).pool(2)
    for figures, after, reset in pool.run("tests.pool_jobs:collective_behind_the_ledgers_back"):
        assert figures == {} and after == "ModeLedger" and reset != "ModeLedger"


def test_torch_rule_lookups_answer_none_for_the_meter_and_ask_the_registry_for_other_modes():
    from torch._library import simple_registry
    from torch.utils._python_dispatch import TorchDispatchMode

    class Other(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.library.register_torch_dispatch("aten::mul.Tensor", Other,
                                          lambda mode, func, types, args, kwargs: torch.full((2,), 7.0))
    find = simple_registry.find_torch_dispatch_rule
    assert getattr(find, "__harness_meter__", False), "the meter's shortcut is not installed"
    assert find(torch.ops.aten.mul.Tensor, memory_meter.ModeLedger) is None
    assert find(torch.ops.aten.mul.Tensor, Other) is not None
    with Other():
        assert torch.equal(torch.ones(2) * torch.ones(2), torch.full((2,), 7.0))
    with memory_meter.ModeLedger([]):
        assert torch.equal(torch.ones(2) * torch.ones(2), torch.ones(2))
