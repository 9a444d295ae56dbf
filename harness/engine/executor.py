"""Rank-side execution of one case: build this rank's shard, run the target, record what happened.

Nothing here judges the target. It records outputs, flags, gradients, input integrity, memory and
collectives in an `Observation`, so that the checks in the main process decide, against one
oracle run. An exception raised by the target is an observation too.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from harness import reference
from harness.base import levels
from harness.cases.case import Case, DistillCase, KernelCase, LinearCase, WrapperCase
from harness.engine.calls import (
    DistillShard,
    KernelShard,
    LinearShard,
    cp_local,
    cp_local_logits,
    grad_context,
    group_coordinates,
    laid_out,
    shard,
    tokens_laid_out,
    tp_group,
    view_of,
    weighted,
)
from harness.engine.observations import HARNESS_STEP, KernelPass, Observation, RankResult, TensorMeta
from harness.engine.state_watch import watched, watching
from harness.engine.warnings_seen import sorted_warnings
from harness.meters import trace
from harness.meters.matmul_flops import Work
from harness.meters.memory_meter import Meter
from harness.reference.cp import response_positions
from harness.targets import Target, load_target

CASE_JOB = "harness.engine.executor:case_job"


class HarnessStepError(Exception):
    """The harness's own step around the call (building the upstream loss) cannot use what the
    routine returned: a finding about the output's shape, not a crash of the routine. `key`: the
    output it could not use (`log_probs`, `entropy`)."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


class _Integrity:
    """Snapshot of the caller's tensors: values and version counters must survive the call."""

    def __init__(self, **tensors: torch.Tensor | None):
        self.tensors = {k: v for k, v in tensors.items() if v is not None}
        self.values = {k: v.detach().clone() for k, v in self.tensors.items()}
        self.versions = {k: v._version for k, v in self.tensors.items()}

    def problems(self, stage: str) -> list[str]:
        out = []
        for k, t in self.tensors.items():
            if t._version != self.versions[k]:
                out.append(f"{k}: version counter {self.versions[k]} -> {t._version} after {stage} (in-place write)")
            if not torch.equal(t.detach(), self.values[k]) and not _same_with_nan(t.detach(), self.values[k]):
                out.append(f"{k}: values changed after {stage}")
        return out


def _same_with_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _detached(t: Any) -> Any:
    return t.detach().cpu().clone() if isinstance(t, torch.Tensor) else t


def metered(target: Target) -> bool:
    """Whether the memory meter may run around the target's calls: not around a compiled routine,
    which the meter would run eagerly (compiled code allocates past the dispatcher, where no ledger
    sees it)."""
    return target.supports("eager")


_AUTOMATIC_DYNAMIC: bool | None = None  # torch's setting, kept the first time it is changed


def compile_per_signature(target: Target) -> None:
    """Before each case: every distinct signature (sizes, dtypes, grad mode) of a compiled routine
    (`eager` False) compiles once, statically, as a process of its own compiles its first call, and
    stays cached. So a case is judged on what it does, as `harness repro` runs it alone, and not on
    what earlier cases left in this worker: with torch's defaults a size seen second would compile
    a dynamic-shape graph (whose last bits may differ), and a pool process, which sees every size,
    dtype and grad mode of a whole run, far more than one training process does, would reach
    Dynamo's recompile limit, past which a fullgraph=True routine raises and any other runs eagerly.
    A routine that does not declare `eager` False keeps torch's automatic dynamic shapes, as in
    training, and the recompile limits are lifted for it too: a helper it compiles itself (verl's
    `mul_reduce`) would otherwise run compiled for the signatures a worker met first and eagerly
    for the later ones, and a no-grad call could differ in its last bits from the training path
    only because of the cases that ran before it in that worker."""
    global _AUTOMATIC_DYNAMIC
    import torch._dynamo.config as dynamo

    if _AUTOMATIC_DYNAMIC is None:
        _AUTOMATIC_DYNAMIC = dynamo.automatic_dynamic_shapes
    dynamo.automatic_dynamic_shapes = _AUTOMATIC_DYNAMIC if target.supports("eager") else False
    dynamo.recompile_limit = dynamo.accumulated_recompile_limit = 1 << 30


def _observed_call(inp: Any, target: Target, case: Any, group: Any, meter: Meter, integrity: "_Integrity",
                   obs: Observation) -> tuple[Any, Any]:
    """The metered forward call; its outputs, their metadata and the inputs' integrity go into `obs`."""
    with watched(f"{case.level} forward"), meter.forward():
        log_prob, entropy = inp.call(target, case, group)
    meter.outputs(log_prob, entropy)
    obs.log_prob, obs.entropy = _detached(log_prob), _detached(entropy)
    obs.log_prob_meta, obs.entropy_meta = TensorMeta.of(log_prob), TensorMeta.of(entropy)
    obs.integrity = integrity.problems("forward")
    obs.stage = "forward"
    return log_prob, entropy


def _call(inp: KernelShard | LinearShard, target: Target, case: Any, group: Any) -> tuple[Any, Any]:
    with watched(f"{case.level} forward"):
        return inp.call(target, case, group)


def _backward(loss: torch.Tensor, case: Case) -> None:
    with watched(f"{case.level} backward"):
        loss.backward()


def run_kernel(case: KernelCase, target: Target, rank: int, group: Any, device: torch.device,
               obs: Observation, meter_memory: bool = True, cp_rank: int = 0) -> None:
    """Fills `obs` as it goes: a backward that raises leaves the forward's observations. The call
    runs in the case's context; a two-call context's second call is outside the memory meter's
    forward (and, accumulating, its backward too), so the figures stay those of one call."""
    inp = KernelShard.of(case, rank, device)
    other = KernelShard.of(case.second(), rank, device) if case.context == "two_inputs" else None
    integrity = _Integrity(logits=inp.logits, tokens=inp.tokens, log_prob_keep_mask=inp.keep_mask)
    meter = Meter((inp.logits, inp.tokens, inp.keep_mask), device, meter_memory and metered(target))
    with grad_context(case.context):
        log_prob, entropy = _observed_call(inp, target, case, group, meter, integrity, obs)
        loss = inp.loss(log_prob, entropy)
        if case.context == "two_calls":  # the same logits through a second call, one graph
            loss = loss + inp.loss(*_call(inp, target, case, group), second=True)
        if other is not None:  # other logits and tokens through a second call, one graph
            loss = loss + other.loss(*_call(other, target, case, group))
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        with watched(f"{case.level} backward"), meter.backward():
            loss.backward()
        meter.gradients(inp.grad())
        if other is not None:
            obs.grad_2 = _detached(other.grad())
        if case.context == "accumulate":  # a second microbatch into the same .grad
            loss = inp.loss(*_call(inp.again(), target, case, group), second=True)
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                _backward(loss, case)
        grad = inp.grad()
        obs.grad, obs.grad_meta = _detached(grad), TensorMeta.of(grad)
        obs.integrity += integrity.problems("backward")
    elif case.context == "accumulate":  # no backward: the second microbatch is a second call
        _call(inp.again(), target, case, group)
    obs.memory = meter.figures
    if not case.autograd and case.T > 0:
        obs.training = training_kernel(case, target, rank, group, device)
    obs.stage = "backward"


def training_kernel(case: KernelCase, target: Target, rank: int, group: Any, device: torch.device) -> tuple:
    """The outputs of the same call on the training path (logits requiring grad, autograd on),
    forward only: what a call without autograd must equal bit for bit. Its collectives stay out
    of the job's trace."""
    train = case.replace(context="train", requires_grad=True)
    inp = KernelShard.of(train, rank, device)
    with trace.recording():
        log_prob, entropy = _call(inp, target, train, group)
    return _detached(log_prob), _detached(entropy)


def run_linear(case: LinearCase, target: Target, rank: int, group: Any, device: torch.device,
               obs: Observation, meter_memory: bool = True, cp_rank: int = 0) -> None:
    """A fused-linear call on the training path: outputs, flags, both gradients (the hidden states'
    and this rank's weight shard's; None for a frozen one), input integrity and memory, as
    `run_kernel` records them; in a two_inputs context, the second call's gradients too."""
    inp = LinearShard.of(case, rank, device)
    other = LinearShard.of(case.second(), rank, device) if case.context == "two_inputs" else None
    integrity = _Integrity(hidden=inp.hidden, weight=inp.weight, tokens=inp.tokens)
    meter = Meter((inp.hidden, inp.weight, inp.tokens), device, meter_memory and metered(target))
    log_prob, entropy = _observed_call(inp, target, case, group, meter, integrity, obs)
    loss = inp.loss(log_prob, entropy)
    if other is not None:  # another batch of hidden states (and head) through a second call, one graph
        loss = loss + other.loss(*_call(other, target, case, group))
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        with watched(f"{case.level} backward"), meter.backward():
            loss.backward()
        meter.gradients(inp.weight.grad, inp.hidden_grad())
        if other is not None:
            obs.grad_2, obs.grad_hidden_2 = _detached(other.weight.grad), _detached(other.hidden_grad())
        obs.grad, obs.grad_meta = _detached(inp.weight.grad), TensorMeta.of(inp.weight.grad)
        obs.grad_hidden, obs.grad_hidden_meta = _detached(inp.hidden_grad()), TensorMeta.of(inp.hidden_grad())
        obs.integrity += integrity.problems("backward")
    obs.memory = meter.figures
    obs.stage = "backward"
    if meter.active and case.requires_grad and case.frozen != "none" and case.context == "train" and case.T > 0:
        obs.work = frozen_and_trainable_work(case, target, rank, group, device)


def frozen_and_trainable_work(case: LinearCase, target: Target, rank: int, group: Any,
                              device: torch.device) -> tuple[int | None, int | None]:
    """The matmul FLOPs of one forward and backward of a case with a frozen input, and of the same
    case with both inputs trainable (`frozen-input-work`), each a call of its own after the observed
    one, on fresh inputs. The FLOP counter's dispatch mode costs tens of microseconds an op, so
    only these cases pay it, and the observed call runs without it; their collectives stay out of
    the job's trace. A call that raises counts nothing (the observed call has said why)."""
    counts = []
    for c in (case, case.replace(frozen="none")):
        inp, work = LinearShard.of(c, rank, device), Work()
        try:
            with trace.recording(), watched("linear call, its matmul work counted"), work.counting():
                loss = inp.loss(*inp.call(target, c, group))
                if isinstance(loss, torch.Tensor) and loss.requires_grad:
                    loss.backward()
        except Exception:  # noqa: BLE001 - the observed call reports the routine's errors
            work.total = None
        counts.append(work.total)
    return counts[0], counts[1]


def run_distill(case: DistillCase, target: Target, rank: int, group: Any, device: torch.device,
                obs: Observation, meter_memory: bool = True, cp_rank: int = 0) -> None:
    """A distillation call in the case's context: its output (and the top-k's ids), flags, the
    student's (and a differentiable teacher's) gradient, input integrity and memory, as `run_kernel`
    records them; without autograd, the training path's output too."""
    inp = DistillShard.of(case, rank, device)
    integrity = _Integrity(logits=inp.student, teacher_logits=inp.teacher, teacher_topk_log_probs=inp.topk_log_probs,
                           indices=inp.topk_ids)
    meter = Meter((inp.student, inp.teacher, inp.topk_log_probs, inp.topk_ids), device,
                  meter_memory and metered(target))
    with grad_context(case.context):
        with watched("distill forward"), meter.forward():
            out, ids = inp.call(target, case, group)
        meter.outputs(out, ids)
        obs.log_prob, obs.log_prob_meta = _detached(out), TensorMeta.of(out)
        obs.indices, obs.indices_meta = _detached(ids), TensorMeta.of(ids)
        obs.integrity = integrity.problems("forward")
        obs.stage = "forward"
        loss = inp.loss(out)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        with watched("distill backward"), meter.backward():
            loss.backward()
        teacher_grad = inp.teacher.grad if inp.teacher is not None else None
        meter.gradients(inp.grad(), teacher_grad)
        grad = inp.grad()
        obs.grad, obs.grad_meta = _detached(grad), TensorMeta.of(grad)
        obs.grad_teacher = _detached(teacher_grad)
        obs.integrity += integrity.problems("backward")
    obs.memory = meter.figures
    if not case.autograd and case.T > 0:
        train = case.replace(context="train")
        with trace.recording():
            out, _ = DistillShard.of(train, rank, device).call(target, train, group)
        obs.training = (_detached(out), None)
    obs.stage = "backward"


def wants_kernel_pass(case: WrapperCase, target: Target) -> bool:
    """Whether a wrapper job also runs its rows (at CP > 1, its CP rank's) through the target's
    kernel, to compare with."""
    return case.kernel_comparable and target.kernel is not None


def cp_weights(case: WrapperCase, per_sample: list[torch.Tensor] | None, cp_rank: int) -> list[torch.Tensor] | None:
    """The upstream weights of the response values CP rank `cp_rank` returns: per sample, the global
    weights at its response positions. The ranks' losses then sum to the whole sequence's loss."""
    if per_sample is None or case.cp == 1:
        return per_sample
    return [w[response_positions(L, R, case.cp, cp_rank)] for w, L, R in
            zip(per_sample, case.total_lengths, case.response_lengths, strict=True)]


class _WrapperCall:
    """A wrapper case's inputs on one rank (at CP > 1, its CP rank's rows), laid out as the case says,
    and the call itself."""

    def __init__(self, case: WrapperCase, target: Target, rank: int, device: torch.device, requires_grad: bool = True,
                 cp_rank: int = 0):
        self.case, self.target, self.device = case, target, device
        self.full = full = case.inputs()
        self.weights = {k: cp_weights(case, getattr(full, k), cp_rank)
                        for k in ("w_log_probs", "w_entropy", "w_log_probs_2", "w_entropy_2")}
        self.values = shard(cp_local_logits(case, full.logits, cp_rank), rank, case.v_local, device)
        self.source, x = laid_out(self.values, case.layout, requires_grad)
        self.logits = x.unsqueeze(0)
        tokens = [t.to(device) for t in full.unconcat_tokens]
        if case.token_layout != "contiguous" and tokens:  # every sample's tokens a slice of one buffer
            tokens = list(torch.split(tokens_laid_out(torch.cat(tokens), case.token_layout), list(case.total_lengths)))
        self.tokens = tokens
        self.top_p_ids, self.top_p_offsets = _to(full.top_p_token_ids, device), _to(full.top_p_token_offsets, device)

    def __call__(self) -> tuple[list[torch.Tensor], Any]:
        with watched("wrapper forward"):
            return self._call()

    def _call(self) -> tuple[list[torch.Tensor], Any]:
        c = self.case
        assert self.target.wrapper is not None  # a case runs only at the levels its target has
        _, res = self.target.wrapper(
            self.logits, args=c.args(), unconcat_tokens=self.tokens,
            total_lengths=list(c.total_lengths), response_lengths=list(c.response_lengths),
            **self.target.kwargs("wrapper", with_entropy=c.with_entropy, top_p_token_ids=self.top_p_ids,
                                 top_p_token_offsets=self.top_p_offsets))
        return list(res.get("log_probs", [])), res.get("entropy")

    def loss(self, log_probs: list, entropy: Any, second: bool = False) -> Any:
        w = self.weights
        w1, w2 = (w["w_log_probs_2"], w["w_entropy_2"]) if second else (w["w_log_probs"], w["w_entropy"])
        assert w1 is not None and w2 is not None  # a context with a second call has its weights
        for key, values, weights in (("log_probs", log_probs, w1), ("entropy", entropy if isinstance(entropy, list) else [], w2)):
            for i, (t, wt) in enumerate(zip(values, weights or [], strict=False)):
                if isinstance(t, torch.Tensor) and t.requires_grad and t.numel() != wt.numel():
                    raise HarnessStepError(self._step_refused(key, i, t.numel(), wt.numel()), key)
        # The routine's count of entries may be wrong: wrapper-extraction reports it, the backward still runs.
        loss = sum((weighted(t, w, self.device) for t, w in zip(log_probs, w1, strict=False)), 0.0)
        if entropy is not None:
            loss = loss + sum((weighted(t, w, self.device) for t, w in zip(entropy, w2, strict=False)), 0.0)
        return loss

    def grad(self) -> torch.Tensor | None:
        g = self.source.grad
        return None if g is None else view_of(g, self.case.layout if self.case.layout != "nonleaf" else "")

    def _step_refused(self, key: str, i: int, got: int, want: int) -> str:
        where = "response positions" if self.case.cp == 1 else "response positions this CP rank's zigzag chunks hold"
        return (f"the harness's loss step, not the routine, stopped here: it weighs {key}[{i}] by the upstream "
                f"gradient of the {want} {where}, and the routine returned {got} values (the routine itself "
                f"returned without raising); this rank ran no backward")


def run_wrapper(case: WrapperCase, target: Target, rank: int, group: Any, device: torch.device, obs: Observation,
                meter_memory: bool = True, cp_rank: int = 0) -> None:
    """The wrapper's rank side. A wrapper takes its groups from megatron-core's parallel_state, not
    from `group`; what it asks of the CP state is recorded (`cp_queries`)."""
    with cp_queries(obs):
        _run_wrapper(case, target, rank, device, obs, cp_rank, meter_memory)


def _run_wrapper(case: WrapperCase, target: Target, rank: int, device: torch.device, obs: Observation,
                 cp_rank: int = 0, meter_memory: bool = True) -> None:
    call = _WrapperCall(case, target, rank, device, cp_rank=cp_rank)
    logits, tokens = call.logits, call.tokens
    integrity = _Integrity(logits=logits, **{f"tokens[{i}]": t for i, t in enumerate(tokens)})
    meter = Meter((logits, tokens, call.top_p_ids, call.top_p_offsets), device, meter_memory and metered(target))
    with grad_context(case.context):
        with watched("wrapper forward"), meter.forward():
            log_probs, entropy = call._call()
        meter.outputs(log_probs, entropy)
        obs.n_forward_collectives = trace.count()
        obs.log_prob = [_detached(t) for t in log_probs]
        obs.log_prob_meta = [TensorMeta.of(t) for t in log_probs]
        if entropy is not None:
            obs.entropy = [_detached(t) for t in entropy]
            obs.entropy_meta = [TensorMeta.of(t) for t in entropy]
        obs.integrity = integrity.problems("forward")
        obs.stage = "forward"
        loss = call.loss(log_probs, entropy)
        if case.context == "two_calls":
            loss = loss + call.loss(*call(), second=True)
        other = _WrapperCall(case.second(), target, rank, device, cp_rank=cp_rank) if case.context == "two_inputs" \
            else None
        if other is not None:  # another batch through a second call, one graph
            loss = loss + other.loss(*other())
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        with watched(f"{case.level} backward"), meter.backward():
            loss.backward()
        meter.gradients(call.grad())
        if other is not None:
            obs.grad_2 = _detached(other.grad())
        if case.context == "accumulate":
            call.logits = view_of(call.source, case.layout).unsqueeze(0)  # the next microbatch's forward
            loss = call.loss(*call(), second=True)
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                _backward(loss, case)
        obs.grad = _detached(call.grad())
        obs.integrity += integrity.problems("backward")
    elif case.context == "accumulate":
        call()
    obs.memory = meter.figures
    if wants_kernel_pass(case, target):
        obs.kernel_pass = kernel_pass(case, target, call.values, device, meter_memory, cp_rank)
    if not case.autograd and case.T > 0:
        train = _WrapperCall(case.replace(context="train"), target, rank, device, cp_rank=cp_rank)
        with trace.recording():
            lps, ents = train()
        obs.training = ([_detached(t) for t in lps], None if ents is None else [_detached(t) for t in ents])
    obs.stage = "backward"


def kernel_pass(case: WrapperCase, target: Target, values: torch.Tensor, device: torch.device,
                meter_memory: bool = True, cp_rank: int = 0) -> KernelPass:
    """The target kernel on the wrapper's rows, at the case's chunk size and unchunked, called as
    the wrapper calls it (`[1, T, V_local]` logits, laid out alike, squeezed, shifted targets, the
    same per-sample losses), on the training path. Its collectives stay out of the job's trace. The
    temperature is left out: it changes neither the collectives nor, at temperature 1 where memory
    is compared, the bytes. At CP > 1, CP rank `cp_rank`'s rows, padding included, and only the
    forward's collectives: its memory is not compared there (harness.checks.CASE_LIMITS)."""
    full = case.inputs()
    tokens = reference.shifted_targets(full.unconcat_tokens, list(case.total_lengths))
    # A padding row's target: 0, as a sample's last row's.
    tokens = cp_local(case, tokens, cp_rank, lambda n: tokens.new_zeros(n)).to(device)
    out = KernelPass()
    for chunk in (case.chunk_size, -1):
        # `logits` is a view, or (layout "nonleaf") an op's output: the gradient lands on `source`.
        source, logits = laid_out(values.detach().clone(), case.layout, True)
        meter = Meter((logits, tokens), device, meter_memory and metered(target) and case.cp == 1)
        assert target.kernel is not None  # wants_kernel_pass: the target has the kernel level
        with trace.recording() as events, watched("kernel forward (the wrapper's rows)"), meter.forward():
            log_prob, entropy = target.kernel(logits, tokens, tp_group(), **target.kwargs(
                "kernel", with_entropy=case.with_entropy, chunk_size=chunk, log_prob_keep_mask=None,
                with_entropy_grad=case.expects_entropy_grad))
        out.traces[chunk] = list(events)
        if case.cp > 1:
            continue
        meter.outputs(log_prob, entropy)
        loss = _response_loss(case, log_prob, full.w_log_probs, device)
        if isinstance(entropy, torch.Tensor) and entropy.requires_grad:
            loss = loss + _response_loss(case, entropy, full.w_entropy, device)
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            with trace.recording(), watched("kernel backward (the wrapper's rows)"), meter.backward():
                loss.backward()
            meter.gradients(source.grad)
        out.memory[chunk] = meter.figures
    return out


def _response_loss(case: WrapperCase, values: torch.Tensor, weights: list[torch.Tensor], device: torch.device) -> Any:
    # Empty responses too: their slices' backward allocates like any other, in the wrapper job as here.
    flat, loss, offset = values.reshape(-1), 0.0, 0
    for length, resp, w in zip(case.total_lengths, case.response_lengths, weights, strict=True):
        a = offset + length - resp - 1
        offset += length
        loss = loss + (flat[a:a + resp] * w.to(device=device, dtype=flat.dtype)).sum()
    return loss


def _to(ts: list | None, device: torch.device) -> list | None:
    return None if ts is None else [t.to(device) if isinstance(t, torch.Tensor) else t for t in ts]


CP_QUERIES = ("get_context_parallel_world_size", "get_context_parallel_rank", "get_context_parallel_group",
              "get_context_parallel_global_ranks")


@contextlib.contextmanager
def cp_queries(obs: Observation) -> Iterator[None]:
    """While it is entered, a routine that asks megatron-core's parallel_state (`mpu`) for its
    context-parallel group, rank or size sets `obs.cp_queried`: what a wrapper shows of taking CP
    (the `crash` hint that says to declare no CP is given only to a wrapper that never asks)."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        yield
        return
    saved = {name: getattr(parallel_state, name) for name in CP_QUERIES if hasattr(parallel_state, name)}

    def counted(fn: Any) -> Any:
        def query(*args: Any, **kwargs: Any) -> Any:
            obs.cp_queried = True
            return fn(*args, **kwargs)
        return query
    for name, fn in saved.items():
        setattr(parallel_state, name, counted(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(parallel_state, name, fn)


def run_on_rank(case: Case, target: Target, rank: int, device: torch.device, cp_rank: int = 0,
                meter_memory: bool = True) -> RankResult:
    """Run one case on this rank (TP rank `rank` of CP rank `cp_rank`); never raises (an exception is an
    observation). `meter_memory` False: no memory meter (its dispatch mode sees every op, and costs
    several times the call itself), for a run whose checks read no memory figure."""
    result = RankResult(rank)
    group = tp_group()
    compile_per_signature(target)
    with trace.recording() as events, watching(device, case.level) as watch, sorted_warnings() as warned:
        try:
            levels.of(case).run(case, target, rank, group, device, result.obs, meter_memory, cp_rank)
        except Exception as e:  # the target's failure is data
            failed = RankResult.from_exception(rank, e)
            result.error, result.error_kind = failed.error, failed.error_kind
            if isinstance(e, HarnessStepError):
                result.error, result.error_kind = str(e), HARNESS_STEP
                result.obs.step_refused = e.key
            result.obs.traceback = failed.obs.traceback
    result.trace = list(events)
    result.obs.side_effects = watch.findings
    result.obs.warnings = [str(w) for w in warned]
    return result


def case_job(ctx: Any, case: Case, target_spec: str, meter_memory: bool = True) -> RankResult:
    """Worker-side entry (`pool.run(CASE_JOB, case, spec)`): the target resolves once per process.
    In a world of several TP groups, each DP replica runs its own copy of the case on other data
    (`Case.replica`), and each CP rank its rows of it; the driver evaluates every TP group against
    its replica's oracle, sliced for its CP rank."""
    tp_rank, cp_rank, replica, groups = group_coordinates()
    result = run_on_rank(case.replica(replica), load_target(target_spec), tp_rank, ctx.device, cp_rank, meter_memory)
    result.replica, result.cp_rank, result.groups = replica, cp_rank, groups
    return result
