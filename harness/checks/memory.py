"""Memory checks: invariants that hold for every correct routine whatever its design, and the
budget a target declares. Figures come from `harness.meters.memory_meter` (docs/memory.md); comparisons allow
`memory_meter.slack(T)` bytes and budgets `memory_meter.budget_slack(T)`: the O(T) of the contract.

Chunking is not asserted to lower the peak: in eager autograd the backward of row slices allocates
full-size gradients, and a routine that saves its whole softmax has the same retained bytes with
or without chunks. `memory-chunk-passthrough` only asks the wrapper to cost what its kernel costs
at the chunk size it was given, and `memory-logits-dtype` a routine that works in chunks of bf16 or
fp16 logits to keep its float32 work to chunks (a full-size gradient in the logits' dtype is fine).

Named for what it checks, as `targets/mutants/memory.py` holds the defects it is shown to catch.
"""
from __future__ import annotations

import functools
from collections import Counter
from typing import Any, cast

from harness.base import levels as level_registry
from harness.cases.case import DTYPES, NONCONTIGUOUS, LinearCase, WrapperCase
from harness.checks import Evidence, check
from harness.meters import memory_meter
from harness.reference.cp import local_rows

MATRIX_COLUMN = "memory"  # the peers' matrix shows this module's checks as one column
# The evidence of a level whose callers are configured with a chunk size (the wrapper's
# `args.log_probs_chunk_size`): there the float32 work is held to chunks whatever the routine does,
# since not chunking is the configuration ignored, not a design.
CONFIGURED = "configured-chunks"


@functools.lru_cache(maxsize=1024)
def rows(c: Any) -> int:
    """The logits rows each rank holds, which the memory unit T*V_local*4 counts: T, and at CP > 1
    its CP layout's rows, padding included (the same number on every CP rank). The O(T) slack stays
    sized by the whole sequence's T: the all-gather redistribution sums a whole-response vector."""
    if getattr(c, "cp", 1) == 1:
        return c.T
    return len(local_rows(list(c.total_lengths), c.cp, c.cp_layout, 0))


def _unit_name(c: Any) -> str:
    return "T*V_local*4" if getattr(c, "cp", 1) == 1 else f"T_local*V_local*4 (T_local = {rows(c)} rows of CP {c.cp})"


HALF_PRECISION = ("bf16", "fp16")


def _logits_bytes(c: Any) -> int:
    """The logits' own size on a rank, in their dtype: T*V_local*2 for bf16 and fp16 (at CP > 1,
    T_local rows; at the linear level, the [T, V_local] logits in the inputs' dtype)."""
    return rows(c) * c.v_local * DTYPES[c.dtype].itemsize


def _logits_unit_name(c: Any) -> str:
    size = DTYPES[c.dtype].itemsize
    rows_name = "T" if getattr(c, "cp", 1) == 1 else "T_local"
    return f"{rows_name}*V_local*{size}, the {c.dtype} logits' own size"


def _in_logits_unit(c: Any, nbytes: int) -> str:
    """`nbytes` read in the logits' own unit, where that differs from the float32 one."""
    if c.dtype not in HALF_PRECISION:
        return ""
    return f" ({nbytes / _logits_bytes(c):.2f} x {_logits_unit_name(c)})"


def _mem(ev: Evidence, rank: int) -> dict[str, Any]:
    return ev.ranks[rank].obs.memory


def _fmt(n: int) -> str:
    return f"{n:,} B"


def _excess(tensors: list[dict], than: list[dict]) -> str:
    """The tensors of `tensors` that `than` has no counterpart for (same shape, dtype, role)."""
    sig = lambda t: (tuple(t["shape"]), t["dtype"], t["how"])  # noqa: E731
    spare = Counter(sig(t) for t in than)
    extra = []
    for t in tensors:
        if spare[sig(t)]:
            spare[sig(t)] -= 1
        else:
            extra.append(t)
    return _list(extra)


def _list(tensors: list[dict]) -> str:
    if not tensors:
        return "no single tensor stands out"
    return ", ".join(f"{t['dtype']}{t['shape']} {_fmt(t['bytes'])} ({t['how']}, from {t['op']})" for t in tensors[:6])


def _compare_retained(ev: Evidence, twin: Evidence, what: str) -> list[str]:
    allowed = memory_meter.slack(ev.case.T)
    problems = []
    for r in range(len(ev.ranks)):
        a, b = _mem(ev, r), _mem(twin, r)
        if "retained" not in a or "retained" not in b:
            continue
        excess = a["retained"] - b["retained"]
        if excess > allowed:
            problems.append(f"{ev.ranks[r].name}: retained {_fmt(a['retained'])} after forward, {_fmt(excess)} "
                            f"more than {what} ({_fmt(b['retained'])}); allowed {_fmt(allowed)} more. Excess: "
                            f"{_excess(a.get('retained_tensors', []), b.get('retained_tensors', []))}")
    return problems


@check("memory-metric-only", evidence=("memory", "metric-only-entropy"),
       applies=lambda c, t: c.T > 0 and c.requires_grad and c.with_entropy and not c.with_entropy_grad,
       twin=lambda c: c.replace(with_entropy=False, with_entropy_grad=True, loss_terms="both"),
       reads=("autograd", "memory"), twin_in_same_process=True)
def metric_only(ev: Evidence) -> list[str]:
    """A metric-only entropy (with_entropy_grad=False) retains no more than the log-prob-only call
    plus O(T) bytes, in every dtype and with or without a keep mask."""
    return _compare_retained(ev, ev.twins["memory-metric-only"], "the log-prob-only call")


@check("memory-coef-zero", evidence=("samples", "memory"),
       applies=lambda c, t: c.T > 0 and c.with_entropy and not c.expects_entropy_grad,
       twin=lambda c: c.replace(with_entropy=False), reads=("autograd", "memory"),
       twin_in_same_process=True)
def coef_zero(ev: Evidence) -> list[str]:
    """slime #2153: with entropy_coef == 0 (or absent) the wrapper retains what its log-prob-only
    call (with_entropy=False) retains, plus O(T) bytes."""
    return _compare_retained(ev, ev.twins["memory-coef-zero"], "with_entropy=False")


@check("memory-chunk-passthrough", evidence=("samples", "memory"),
       applies=lambda c, t: c.kernel_comparable and c.temperature in (None, 1.0) and t.kernel is not None,
       reads=("autograd", "call-memory", "memory", "kernel-pass-memory"))
def chunk_passthrough(ev: Evidence) -> list[str]:
    """NeMo-RL #2871: args.log_probs_chunk_size reaches the kernel. The wrapper's retained and peak
    bytes match the target kernel's own at that chunk size on the same rows (temperature 1, no
    top-p), within O(T) and the wrapper's `allowance` (a contiguous copy of non-contiguous logits);
    so they differ from the unchunked figures wherever the kernel's do. Above the kernel, the O(T)
    is a budget's (`budget_slack`): a wrapper builds per-token bookkeeping a bare kernel call does
    not (shifted, padded and rolled int64 targets, per-sample outputs padded to the longest), which
    at a small V_local is as large as the chunking's own saving (NeMo-RL's, 32 bytes a row)."""
    c = cast(WrapperCase, ev.case)  # evidence "samples": this level's cases
    problems = []
    for r in range(len(ev.ranks)):
        got, kernel = _mem(ev, r), ev.ranks[r].obs.kernel_pass
        if kernel is None:
            continue
        chunked, whole = kernel.memory[c.chunk_size], kernel.memory[-1]
        for m in memory_meter.METERS:
            if got.get(m) is None or chunked.get(m) is None:
                continue
            # The wrapper may spend its own allowance (a contiguous copy of transposed logits) on top
            # of its kernel's figure, as memory-budget lets it; below it, only O(T).
            allowed, above = memory_meter.slack(c.T), memory_meter.budget_slack(c.T) + allowance(c, m)
            if got[m] - chunked[m] > above or chunked[m] - got[m] > allowed:
                like = " — the unchunked kernel's figure: log_probs_chunk_size ignored" \
                    if whole.get(m) is not None and abs(got[m] - whole[m]) <= allowed else ""
                problems.append(
                    f"{ev.ranks[r].name}: wrapper {m} {_fmt(got[m])}, its kernel at chunk_size={c.chunk_size} "
                    f"{_fmt(chunked[m])}, unchunked {_fmt(whole.get(m) or 0)}; allowed {_fmt(allowed)} less, "
                    f"{_fmt(above)} more (O(T) + the wrapper's allowance){like}. "
                    f"Excess: {_excess(got.get(f'{m}_tensors', []), chunked.get(f'{m}_tensors', []))}")
    return problems


def _chunking_spares(c: Any) -> int:
    """Float32 bytes a call that honours its chunk size spares over the same call unchunked, at the
    least: the rows beyond one chunk, which the unchunked call holds in float32 at once (the contract's
    arithmetic is float32) and a chunked one never does."""
    return (rows(c) - c.chunk_size) * c.v_local * 4 if 0 < c.chunk_size < rows(c) else 0


@check("memory-chunk-effect", evidence=("samples", "memory", CONFIGURED),
       applies=lambda c, t: c.T > 0 and _chunking_spares(c) > 2 * memory_meter.slack(c.T),
       twin=lambda c: c.replace(chunk_size=-1), reads=("call-memory", "memory"), twin_in_same_process=True)
def chunk_effect(ev: Evidence) -> list[str]:
    """NeMo-RL #2871: a caller configured with a chunk size (`args.log_probs_chunk_size`) that splits
    the rows uses it, whatever its kernel does and with no kernel to compare with. A caller is seen to
    use it where its forward's peak holds a tensor of one chunk's rows of the logits, or where some
    memory figure (retained, forward or backward peak) falls below the same call's without a chunk
    size by more than O(T). A design that saves all its float32 work per chunk (slime's kernel saves
    each chunk's softmax) chunks without lowering a figure; a caller that shows neither dropped the
    configured size on its way to the work on the logits (a caller that never passes it down, a
    kernel that ignores it)."""
    c = ev.case
    twin = ev.twins["memory-chunk-effect"]
    allowed = memory_meter.slack(c.T)
    problems = []
    for r in range(len(ev.ranks)):
        got, whole = _mem(ev, r), _mem(twin, r)
        meters = [m for m in memory_meter.METERS if got.get(m) is not None and whole.get(m) is not None]
        if not meters or _works_in_chunks(c, got.get("peak_forward_tensors", [])) or \
                any(whole[m] - got[m] > allowed for m in meters):
            continue
        figures = ", ".join(f"{m} {_fmt(got[m])} (unchunked {_fmt(whole[m])})" for m in meters)
        problems.append(f"{ev.ranks[r].name}: with chunk_size={c.chunk_size} of its {rows(c)} rows its forward holds no "
                        f"chunk of rows and its memory is its unchunked call's within O(T) = {_fmt(allowed)}: {figures}; "
                        "chunks would spare at least "
                        f"{_fmt(_chunking_spares(c))} of float32 work on the rows beyond one chunk: the configured "
                        f"chunk size did not reach the work on the logits. "
                        f"Largest at its forward's peak: {_list(got.get('peak_forward_tensors', []))}")
    return problems


def _backward_reaches_all(c: Any, t: Any) -> bool:
    """Every differentiable output is in the loss, so the backward must free the whole graph (an
    output left out keeps its own graph alive, legitimately, as long as it lives)."""
    return c.T > 0 and c.loss_takes_every_output


@check("memory-backward-frees", evidence=("memory", "memory-allowance"), applies=_backward_reaches_all,
       reads=("autograd", "memory"))
def backward_frees(ev: Evidence) -> list[str]:
    """What the forward retained is freed by the backward (its outputs, which the caller holds,
    excepted), within O(T): nothing [T, V_local]-sized outlives the step, on ctx or elsewhere."""
    allowed = memory_meter.slack(ev.case.T)
    problems = []
    for r in range(len(ev.ranks)):
        m = _mem(ev, r)
        if m.get("leftover") is not None and m["leftover"] > allowed:
            problems.append(f"{ev.ranks[r].name}: {_fmt(m['leftover'])} of the {_fmt(m['retained'])} retained by "
                            f"the forward still alive after backward; allowed {_fmt(allowed)}. "
                            f"Alive: {_list(m['leftover_tensors'])}")
    return problems


# Bytes per recorded top-p nucleus entry: the caller's int32 ids widened to int64, located in the
# rank's shard (an offset id, a selection) and their bool tests. The nucleus is an input of its own
# size, not a multiple of T*V_local: small in production, it reaches T*V at the harness's tiny
# vocabularies and TP 8, where the built-in's three int64 copies alone were 14 units (thorough).
NUCLEUS_ENTRY_BYTES = 32


@functools.lru_cache(maxsize=1024)
def nucleus_entries(c: WrapperCase) -> int:
    """How many token ids the case's recorded nuclei hold (0 without top-p)."""
    if c.top_p == "none":
        return 0
    return sum(int(o[-1]) for o in c.inputs().top_p_token_offsets or () if len(o))


def allowance(c: Any, meter: str) -> int:
    """Bytes a correct routine may spend on `meter` beyond its budget and the O(T) slack: the one
    source every memory check reads (memory-budget, memory-chunk-passthrough, memory-linear-retained
    and the report's table), so no two of them disagree about the same tensor.

    Kernel and wrapper: non-contiguous logits may be copied to a contiguous float32 buffer, which
    the kernel may save (one T*V_local*4 unit); a wrapper's temperature divides out of place (a
    float32 copy, which the kernel may save: one unit) and top-p replay builds a bool keep mask (a
    quarter) and holds a few int64 copies of the recorded nucleus (NUCLEUS_ENTRY_BYTES an entry). Linear level (docs/fused-linear.md): a float32 copy of each input that is not float32
    (hidden [T, H] and the weight shard [V_local, H]); beyond what the forward retains, each gradient
    asked for (an input that requires grad) its float32 accumulator, one float32 product of that
    size, and the result in the input's dtype. A frozen input's gradient gets nothing: a routine that
    computes it anyway spends memory nobody asked for. Hidden states handed over as a strided view
    (`hidden_view`) may be copied contiguous (in their dtype and in float32), and their gradient
    lands in the caller's larger buffer (its spare rows included)."""
    return level_registry.of(c).memory.allowance(c, meter)


class LogitsMemory:
    """The memory rules of a level whose routine takes vocab-sharded logits (the kernel's): a
    non-contiguous view of them may be copied to a contiguous float32 buffer, which the routine may
    save. `on_logits_scale`: its memory is weighed in multiples of the logits' T*V_local*4
    (`HARNESS_MEMORY_BUDGET`, the report's memory table)."""
    on_logits_scale = True

    def allowance(self, c: Any, meter: str) -> int:
        units = 1.0 if getattr(c, "layout", "contiguous") in NONCONTIGUOUS else 0.0
        return int(units * memory_meter.unit(rows(c), c.v_local)) + self.extra(c)

    def extra(self, c: Any) -> int:
        return 0

    def input_shaped(self, c: Any, t: dict) -> bool:
        """A float32 buffer shaped like an input other than the logits (whose copies the allowance grants)."""
        return False

    def logits_inputs(self, c: Any) -> int:
        """How many [T, V_local] logits the call takes."""
        return 1


class DistillMemory(LogitsMemory):
    """The distillation level's: held to no budget (memory-no-vocab-gather weighs it), and a divergence
    from a teacher handed over whole (full and top-k teachers; a teacher pass's [T, K] top-k is not
    logits) takes two logits inputs, the student's and the teacher's."""
    on_logits_scale = False

    def logits_inputs(self, c: Any) -> int:
        return 2 if c.function == "divergence" and c.teacher != "given" else 1


class WrapperMemory(LogitsMemory):
    """The wrapper's: a temperature divides out of place (a float32 copy, which the kernel may save: one
    unit); top-p replay builds a bool keep mask (a quarter) and holds int64 copies of the nucleus."""

    def allowance(self, c: Any, meter: str) -> int:
        units = (1.0 if c.temperature not in (None, 1.0) else 0.0) + (0.25 if c.top_p != "none" else 0.0)
        return super().allowance(c, meter) + int(units * memory_meter.unit(rows(c), c.v_local))

    def extra(self, c: Any) -> int:
        return NUCLEUS_ENTRY_BYTES * nucleus_entries(c)


class LinearMemory(LogitsMemory):
    """The fused-linear level's: float32 copies of the half-precision inputs, and each gradient asked for;
    held to O(T*H) (memory-linear-retained), not to the logits' scale."""

    on_logits_scale = False

    def allowance(self, c: Any, meter: str) -> int:
        upcast = 0 if DTYPES[c.dtype] == DTYPES["fp32"] else 4 * c.H * (c.T + c.v_local)
        if getattr(c, "hidden_view", "contiguous") != "contiguous":
            upcast += (8 + DTYPES[c.dtype].itemsize) * (c.T + 1) * c.H
        if meter == "retained":
            return upcast
        per_entry = 8 + DTYPES[c.dtype].itemsize
        asked = (c.T * c.H if c.hidden_grad else 0) + (c.v_local * c.H if c.weight_grad else 0)
        return upcast + per_entry * asked

    def input_shaped(self, c: Any, t: dict) -> bool:
        return c.H in t["shape"]


def budget_use(c: Any, nbytes: int, meter: str = "peak_backward") -> float:
    """A memory figure on the scale of HARNESS_MEMORY_BUDGET: multiples of T*V_local*4 bytes beyond
    what every budget is given on top (the O(T) slack, and the case's `allowance`). The one rule
    of `memory-budget` and of the report's memory table: a figure fails when this exceeds its budget."""
    return (nbytes - memory_meter.budget_slack(c.T) - allowance(c, meter)) / memory_meter.unit(rows(c), c.v_local)


@check("memory-budget", evidence=("memory", "memory-allowance"), applies=lambda c, t: c.T > 0 and bool(t.memory_budget),
       reads=("call-memory", "memory"),
       requires=lambda t, cp: None if t.memory_budget else "the target declares no `HARNESS_MEMORY_BUDGET` "
                                                           "(docs/check-your-routine.md, memory budget)")
def budget(ev: Evidence) -> list[str]:
    """The target's declared HARNESS_MEMORY_BUDGET: each figure (retained, peak_forward,
    peak_backward) at most its multiple of T*V_local*4 bytes plus O(T) plus the case's `allowance`
    (a wrapper's temperature copy and keep mask; at the linear level the input copies and the
    gradients asked for, none for a frozen input); on CUDA the allocator's figures too, with 512 B
    of allocator rounding per live storage."""
    c = ev.case
    unknown = sorted(set(ev.target.memory_budget) - set(memory_meter.METERS))
    if unknown:
        return [f"HARNESS_MEMORY_BUDGET has unknown key(s) {unknown}; known: {list(memory_meter.METERS)}"]
    unit = memory_meter.unit(rows(c), c.v_local)
    problems = []
    for r in range(len(ev.ranks)):
        m = _mem(ev, r)
        for meter, mult in ev.target.memory_budget.items():
            got = m.get(meter)
            if got is not None and budget_use(c, got, meter) > mult:
                allowed = int(mult * unit) + allowance(c, meter) + memory_meter.budget_slack(c.T)
                problems.append(f"{ev.ranks[r].name}: {meter} {_fmt(got)} = {got / unit:.2f} x {_unit_name(c)}"
                                f"{_in_logits_unit(c, got)}, budget {mult} x + allowances = {_fmt(allowed)}. "
                                f"Largest: {_list(m.get(f'{meter}_tensors', []))}")
            cuda = m.get(f"cuda_{meter}")
            if cuda is not None and budget_use(c, cuda - memory_meter.CUDA_BLOCK * (m.get(f"{meter}_count") or 0), meter) > mult:
                problems.append(f"{ev.ranks[r].name}: CUDA allocator {meter} {_fmt(cuda)} = {cuda / unit:.2f} x "
                                f"{_unit_name(c)}, above the budget of {mult} x (with {memory_meter.CUDA_BLOCK} B rounding "
                                f"per storage)")
    return problems


def linear_retained_allowance(c: LinearCase) -> int:
    """What a fused-linear routine may retain after its forward (docs/fused-linear.md): its
    `allowance` (a float32 copy of each input that is not float32 already, i.e. O(T*H + V_local*H)
    bytes) plus O(T), and nothing [T, V_local]: the point of fusing the head is that the logits are
    recomputed in backward, never kept."""
    return allowance(c, "retained") + memory_meter.budget_slack(c.T)


@check("memory-linear-retained", evidence=("linear-memory",), applies=lambda c, t: c.T > 0 and c.grad_on, reads=("memory",))
def linear_retained(ev: Evidence) -> list[str]:
    """The fused-linear forward retains O(T*H), not O(T*V_local): at most a float32 copy of the
    hidden states and of the weight shard when they are not float32, plus O(T) row statistics and
    the outputs. A routine that saves its [T, V_local] logits or softmax for backward fails."""
    c = cast(LinearCase, ev.case)  # evidence "linear-memory": this level's cases
    allowed = linear_retained_allowance(c)
    problems = []
    for r in range(len(ev.ranks)):
        m = _mem(ev, r)
        got = m.get("retained")
        if got is not None and got > allowed:
            problems.append(f"{ev.ranks[r].name}: retained {_fmt(got)} after forward = "
                            f"{got / memory_meter.unit(c.T, c.v_local):.2f} x T*V_local*4; allowed {_fmt(allowed)} "
                            f"(float32 input copies + O(T)). "
                            f"Largest: {_list(m.get('retained_tensors', []))}")
    return problems


# ---------------------------------------------------------------------------- the logits' own dtype
# The ops of an upcast of a tensor as a whole (`.float()`, `.to(torch.float32)`), as the meter names them.
_UPCASTS = ("_to_copy", "to", "copy_")
_WIDE = ("float32", "float64")  # the dtypes of float32 work (float64 too), as the meter names them
_ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}  # the float dtypes, by the meter's names
# The float32 work a chunked backward may hold at once beyond what its forward retained, in chunks of
# [chunk_size, V] float32 (the full vocab: a gathering design's chunk), for each logits input it takes
# (`LogitsMemory.logits_inputs`: a distillation teacher's too). The designs measured hold at most 8.3
# of one input's, two calls' backward at once, and 10.7 of a student's and a teacher's (docs/memory.md,
# "In the logits' own dtype"); a [T, V_local] float32 buffer in pieces stands out of it once
# T / chunk_size passes 16 * TP (32 * TP with a teacher's logits).
WORK_CHUNKS = 16
# The gradient of a float32 output of the logits' own shape (the sharded log-softmax's) is the
# caller's, and float32 by the contract: a loss of elementwise steps holds two at once in its backward,
# one step's incoming gradient and its outgoing one (the harness's weighs the output and zeroes its
# non-finite entries). Measured: two, on the built-in routine and the distillation control.
OUTPUT_GRADIENTS = 2


def _chunked_half_precision(c: Any, t: Any) -> bool:
    """Half-precision logits, a chunk size that splits the rows, and a [T, V_local] tensor that
    stands out of the O(T) slack (so it cannot be a handful of [T] vectors)."""
    return (c.T > 0 and c.dtype in HALF_PRECISION and 0 < c.chunk_size < rows(c)
            and memory_meter.unit(rows(c), c.v_local) > memory_meter.slack(c.T))


def _sig(t: dict, with_how: bool) -> tuple:
    return (tuple(t["shape"]), t["dtype"], t["op"], t["how"] if with_how else t["how"] == "saved")


def _not_retained(peak: list[dict], retained: list[dict], with_how: bool) -> list[dict]:
    """The tensors of a peak that the forward did not retain: the peak's listing less the retained
    one's (multiset, by shape, dtype, op and role). The forward's peak is listed before the outputs
    are marked, so there only "saved" tells roles apart. A tensor no larger than the smallest of a
    full retained listing may be a retained one the listing cut off: it is left out."""
    spare = Counter(_sig(t, with_how) for t in retained)
    floor = min(t["bytes"] for t in retained) if len(retained) >= memory_meter.TOP else -1
    out = []
    for t in peak:
        if spare[_sig(t, with_how)]:
            spare[_sig(t, with_how)] -= 1
        elif t["bytes"] > floor:
            out.append(t)
    return out


def _wide(c: Any, t: dict) -> bool:
    """float32 (or float64) work on the logits: at the linear level not shaped like an input or
    its gradient (a dimension of H: the float32 copies and accumulators its allowance grants)."""
    return t["dtype"] in _WIDE and not level_registry.of(c).memory.input_shaped(c, t)


def _whole(c: Any, t: dict) -> bool:
    """A float32 tensor of all the rank's logits in one piece, laid out as logits are: the rank's rows
    and its V_local columns as its last two dimensions (either way round), any before them 1. A
    chunk's rows gathered to the full vocab, as a gathering design makes them, are not; nor are
    top-k log-probs stacked for student and teacher, [2, chunk_size, K] or [2, T, K], whose sizes
    may equal T or V_local."""
    shape = list(t["shape"])
    while len(shape) > 2 and shape[0] == 1:
        shape.pop(0)
    return _wide(c, t) and tuple(shape) in ((rows(c), c.v_local), (c.v_local, rows(c)))


def _whole_outputs(c: Any, obs: Any) -> int:
    """How many of the call's differentiable outputs are float32 tensors of the logits' whole shape
    (the sharded log-softmax's [T, V_local]): each one's gradient reaches the backward from the caller."""
    metas = [m for meta in (obs.log_prob_meta, obs.entropy_meta) for m in (meta if isinstance(meta, list) else [meta])]
    return sum(1 for m in metas if m is not None and m.requires_grad and
               _whole(c, {"shape": m.shape, "dtype": m.dtype}))


def _works_in_chunks(c: Any, peak: list[dict]) -> bool:
    """The routine is seen to chunk: its forward's peak holds a tensor of one chunk's rows of the
    logits ([chunk_size, V_local], or the last chunk's rows), in any float dtype. A routine that
    computes every row at once (the naive routine, verl's log-probs through megatron-core's cross
    entropy) holds only whole [T, V_local] tensors: not chunking at all is a design, which the
    budget weighs, not this check."""
    sizes = {c.chunk_size, rows(c) % c.chunk_size} - {0}
    return any(t["dtype"] in _ITEMSIZE and c.v_local in t["shape"] and
               any(r in t["shape"] and t["bytes"] == r * c.v_local * _ITEMSIZE[t["dtype"]] for r in sizes)
               for t in peak)


@check("memory-logits-dtype", evidence=("memory-logits",), applies=_chunked_half_precision,
       reads=("memory",))
def logits_dtype(ev: Evidence) -> list[str]:
    """NeMo-RL #2872: with bf16 or fp16 logits and a chunk size that splits the rows, a routine that
    works in chunks keeps its float32 working set to chunks. The forward's peak holds no float32 copy
    of all the logits that the forward then frees (a whole-tensor `.float()` in front of the chunks);
    the backward's peak holds no float32 (or float64) buffer of all the logits that the backward
    allocated (the gradient is built and returned in the logits' dtype), and the float32 work it
    allocated is at most 16 chunks of [chunk_size, V] per logits input (a teacher's too) plus O(T).
    What the forward retained, saved for backward or kept on ctx (a saved float32 softmax), is
    `memory-budget`'s to weigh, not this check's; so is a routine whose forward's peak holds no chunk
    of rows (every row at once, by design), except at a level whose callers are configured with the
    chunk size (evidence `configured-chunks`, the wrapper's `args.log_probs_chunk_size`): there the
    float32 work is held to chunks whatever the routine does, the forward's freed float32 work too
    (16 chunks per logits input plus O(T)), so a caller that drops its chunk size, or upcasts the whole
    logits in front of a chunked kernel, is seen. An output of the logits' own shape in float32 (the
    sharded log-softmax) has a whole float32 gradient from the caller's loss: OUTPUT_GRADIENTS such
    buffers each are the caller's."""
    c = ev.case
    n = rows(c)
    chunk = c.chunk_size * c.vocab * 4
    chunks = WORK_CHUNKS * level_registry.of(c).memory.logits_inputs(c)
    work = chunks * chunk + memory_meter.slack(c.T)
    whole_name = f"all {n}x{c.v_local} = {n * c.v_local:,} logits entries of the rank ({c.dtype})"
    configured = CONFIGURED in level_registry.of(c).evidence
    problems = []
    for r in range(len(ev.ranks)):
        m, name = _mem(ev, r), ev.ranks[r].name
        chunked = _works_in_chunks(c, m.get("peak_forward_tensors", []))
        if not (chunked or configured):
            continue
        # A caller that never chunks was configured to: its own path, or its kernel, dropped the size.
        dropped = "" if chunked else (f"; its forward holds no chunk of {c.chunk_size} rows: the configured chunk size "
                                      "did not reach the work on the logits")
        retained = m.get("retained_tensors", [])
        transient = [t for t in _not_retained(m.get("peak_forward_tensors", []), retained, with_how=False)
                     if t["how"] != "saved"]
        forward = [t for t in transient if _whole(c, t)]
        spent = [t for t in transient if _wide(c, t)]
        # What the forward keeps is the budget's, except at a caller configured to chunk: a float32
        # copy of all its logits kept for the backward is the upcast chunking exists to avoid.
        kept = [t for t in retained if configured and t["op"] in _UPCASTS and _whole(c, t)]
        if kept:
            problems.append(f"{name}: the forward keeps a float32 copy of {whole_name} for the backward, with "
                            f"chunk_size={c.chunk_size}: {_list(kept)}{_in_logits_unit(c, kept[0]['bytes'])}; a caller "
                            f"configured with a chunk size hands its kernel the logits in their dtype{dropped}")
        if m.get("peak_forward") is not None and forward:
            problems.append(f"{name}: the forward's peak ({_fmt(m['peak_forward'])}) holds a float32 copy of "
                            f"{whole_name}, freed before the forward returned, with chunk_size={c.chunk_size}: "
                            f"{_list(forward)}{_in_logits_unit(c, forward[0]['bytes'])}{dropped}")
        elif configured and m.get("peak_forward") is not None and (held := sum(t["bytes"] for t in spent)) > work:
            problems.append(f"{name}: the forward's peak holds {_fmt(held)} of float32 work freed before it returned, "
                            f"{held / chunk:.1f} chunks of [{c.chunk_size}, {c.vocab}] float32"
                            f"{_in_logits_unit(c, held)}; a caller configured with chunk_size={c.chunk_size} is "
                            f"allowed {chunks} chunks + O(T) = {_fmt(work)}: {_list(spent)}{dropped}")
        if m.get("peak_backward") is None:
            continue
        allocated = [t for t in _not_retained(m.get("peak_backward_tensors", []), retained, with_how=True)
                     if _wide(c, t)]
        whole = [t for t in allocated if _whole(c, t)]
        # The caller's are listed like the routine's (same shape, dtype and role): granted by number.
        callers = whole[:OUTPUT_GRADIENTS * _whole_outputs(c, ev.ranks[r].obs)]
        whole = whole[len(callers):]
        allocated = [t for t in allocated if not any(t is g for g in callers)]
        if whole:
            problems.append(f"{name}: the backward's peak ({_fmt(m['peak_backward'])}) holds a float32 buffer of "
                            f"{whole_name} that the backward allocated, with chunk_size={c.chunk_size}: "
                            f"{_list(whole)}{_in_logits_unit(c, whole[0]['bytes'])}; the gradient belongs in the "
                            f"logits' dtype{dropped}")
        elif (held := sum(t["bytes"] for t in allocated)) > work:
            problems.append(f"{name}: the backward's peak holds {_fmt(held)} of float32 work it allocated, "
                            f"{held / chunk:.1f} chunks of [{c.chunk_size}, {c.vocab}] float32"
                            f"{_in_logits_unit(c, held)}; allowed {chunks} chunks + O(T) = {_fmt(work)}: "
                            f"{_list(allocated)}{dropped}")
    return problems
