"""A finding as one stand-alone script for the routine's maintainers: `harness repro --script`.

The script needs torch, the routine's own code and what that code needs (megatron-core), never this
harness: the case's inputs written out exactly (drawn from the case's seed; saved beside the script
when they are large), the routine called as its trainer calls it (a peer adapter's harness-free
call, `HARNESS_SCRIPT`, or a module's own contract function), over gloo with
`torch.multiprocessing` ranks at TP > 1, a float64 reference computed in the script, and the
finding's own bound (the harness's float32 error analysis, written out per entry) and message
(`tolerance.compare`'s code, embedded). It exits 1 when the defect is there, 0 when it is not, 2
when the case could not be run (an import missing, a rank that never finished).

A peer adapter declares what its script needs:

    HARNESS_SCRIPT = {"files": {"vp": ("swift/megatron/trainers/vocab_parallel_utils.py",)},
                      "kernel": swift_kernel, "megatron": True, "how": "git clone ... && export PYTHONPATH=..."}

`files`: the routine's own source files (each found under an entry of `sys.path`, newest location
first, and loaded alone, as `targets.peers._source` does), passed in that order as the leading
arguments of the call; `kernel` / `linear`: the call, a function of those modules and the
contract's arguments that imports nothing but torch and megatron-core (its source is embedded);
`megatron`: initialise megatron-core's `parallel_state` (the routine takes its group from there);
`how`: how to get the peer's tree. An adapter whose routine is not tensor-parallel
(`HARNESS_CAPABILITIES["tensor_parallel"]` False) has TP 1 scripts only: at TP > 1 the harness's
gather of the shards would be in the script, not the peer's code.
"""
from __future__ import annotations

import ast
import inspect
import math
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from harness.cases.case import Case, KernelCase, LinearCase
from harness.checks import oracle, tolerance
from harness.checks.terms import alone, loss_terms
from harness.meters import matmul_flops
from harness.targets import Target, is_file_spec

SCRIPT_CHECKS = {"kernel": ("values", "gradients", "finite", "crash", "empty-input"),
                 "linear": ("values", "gradients", "finite", "crash", "empty-input", "frozen-input-work")}
LITERAL_LIMIT = 20_000  # input and bound entries written into the script; more are saved beside it
HARNESS_PACKAGES = ("harness", "cases", "reference")


@dataclass(frozen=True)
class Recipe:
    """How a script calls the target's routine at one level."""
    files: dict[str, tuple[str, ...]]  # the routine's own files, loaded from the tree on sys.path
    call: Callable[..., Any] | None  # a peer's harness-free call; None: the module's own function
    module: str = ""  # the module to import the routine from (a module target)
    file: str = ""  # the file to load it from (a file target)
    megatron: bool = False
    how: str = ""
    tensor_parallel: bool = True
    name: str = ""  # whose routine, in the script's title


def _imports_harness(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(n.split(".")[0] in HARNESS_PACKAGES for n in names):
            return True
    return False


_recipes: dict[tuple[str, str], Recipe | str] = {}


def recipe(target: Target, level: str) -> Recipe | str:
    """The target's recipe at `level`, or why no script can call it without the harness (once per
    target and level in a process)."""
    key = (target.spec, level)
    if key not in _recipes:
        _recipes[key] = _recipe(target, level)
    return _recipes[key]


def _recipe(target: Target, level: str) -> Recipe | str:
    module = sys.modules.get(target.spec) if not is_file_spec(target.spec) else \
        next((m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == target.spec), None)
    declared = getattr(module, "HARNESS_SCRIPT", None)
    if declared is not None:
        if level not in declared:
            return f"{target.spec}'s HARNESS_SCRIPT has no {level} call"
        return Recipe(dict(declared.get("files", {})), declared[level], megatron=bool(declared.get("megatron")),
                      how=str(declared.get("how", "")), tensor_parallel=target.supports("tensor_parallel"),
                      name=str(declared.get("name", "")))
    file = getattr(module, "__file__", None)
    if module is None or file is None:
        return f"{target.spec} is not a module this process imported"
    if target.spec.split(".")[0] in HARNESS_PACKAGES or target.spec.startswith("mutant:") or \
            Path(file).resolve().is_relative_to(Path(__file__).resolve().parents[1]):
        return f"{target.spec} is part of the harness (a script runs without it); its peer adapters declare HARNESS_SCRIPT"
    if _imports_harness(Path(file)):
        return f"{file} imports the harness itself: a script of it would too"
    megatron = "megatron" in Path(file).read_text(encoding="utf-8", errors="replace")
    if is_file_spec(target.spec):
        return Recipe({}, None, file=str(Path(file).resolve()), megatron=megatron)
    return Recipe({}, None, module=target.spec, megatron=megatron)


def script_case(case: Case, check: str, term: str) -> Case:
    """The case the script runs: a gradient finding about one term with both terms in the loss runs
    with that term alone (its own defect, not the other's)."""
    if check == "gradients" and term and len(loss_terms(case)) > 1 and term in alone(case):
        return alone(case)[term]
    return case


def refusal(target: Target, case: Case, check: str) -> str | None:
    """Why no script can be written for `check` on `case`, or None."""
    if case.level not in SCRIPT_CHECKS:
        return f"scripts are written for the kernel and fused-linear levels, not the {case.level} level"
    if check not in SCRIPT_CHECKS[case.level]:
        return f"scripts are written for the checks {', '.join(SCRIPT_CHECKS[case.level])} at the {case.level} level"
    how = recipe(target, case.level)
    if isinstance(how, str):
        return how
    if case.context != "train":
        return f"scripts run the training path (one call); this case's context is {case.context}"
    if isinstance(case, KernelCase) and (case.layout, case.token_layout, case.dp) != ("contiguous", "contiguous", 1):
        return "scripts hand over contiguous logits and tokens in one TP group (layout, token_layout, dp at their defaults)"
    if isinstance(case, LinearCase) and case.hidden_view != "contiguous":
        return "scripts hand over contiguous hidden states (hidden_view=contiguous)"
    if case.tp > 1 and not how.tensor_parallel:
        return (f"{target.spec} is not tensor-parallel: at TP {case.tp} the shards are gathered by the harness, "
                "not by the routine; scripts of it run at TP 1")
    return None


def _literal(t: torch.Tensor) -> str:
    """`_t([...], shape, "dtype")`: the tensor's values exactly (float32/bf16/fp16 values are float64)."""
    flat = t.detach().reshape(-1)
    if t.is_floating_point():
        values = [repr(v) if math.isfinite(v) else ("inf" if v > 0 else "-inf" if v < 0 else "nan")
                  for v in flat.to(torch.float64).tolist()]
    else:
        values = [str(int(v)) for v in flat.tolist()]
    body = textwrap.fill(", ".join(values), 110, initial_indent="    ", subsequent_indent="    ")
    return f"_t([\n{body}\n], {tuple(t.shape)!r}, {str(t.dtype).removeprefix('torch.')!r})"


def _source(fn: Callable[..., Any]) -> str:
    return textwrap.dedent(inspect.getsource(fn))


def _data(case: Case, check: str) -> dict[str, torch.Tensor | None]:
    """What the script holds: the case's full inputs and the finding's bounds."""
    exp = oracle.expected(case) if case.T > 0 else None
    if isinstance(case, KernelCase):
        inp = case.inputs()
        data: dict[str, torch.Tensor | None] = {"LOGITS": inp.logits, "TOKENS": inp.tokens, "KEEP_MASK": inp.keep_mask}
    else:
        assert isinstance(case, LinearCase)
        inp = case.inputs()
        data = {"HIDDEN": inp.hidden, "WEIGHT": inp.weight, "TOKENS": inp.tokens}
    data["W_LOG_PROB"] = inp.w_log_prob
    data["W_ENTROPY"] = inp.w_entropy if case.expects_entropy_grad else None
    if exp is not None and check in ("values", "gradients"):
        data["LOG_PROB_BOUND"] = exp.log_prob_tol if check == "values" else None  # pyright: ignore[reportArgumentType]
        data["ENTROPY_BOUND"] = exp.entropy_tol if check == "values" else None  # pyright: ignore[reportArgumentType]
        data["GRAD_BOUND"] = exp.grad_tol if check == "gradients" else None
        data["GRAD_HIDDEN_BOUND"] = exp.grad_hidden_tol if check == "gradients" else None
    return data


def write(target: Target, case: Case, check: str, term: str, path: Path) -> list[Path]:
    """Write the script for `check` (about `term`, "" for every output) on `case` to `path`, and the
    inputs beside it when they are too large to write out; the files written. Raises ValueError
    with the reason when no script can be written (`refusal`)."""
    case = script_case(case, check, term)
    why = refusal(target, case, check)
    if why:
        raise ValueError(why)
    how = recipe(target, case.level)
    assert isinstance(how, Recipe) and isinstance(case, (KernelCase, LinearCase))  # `refusal` said so
    data = _data(case, check)
    present = {k: v for k, v in data.items() if v is not None}
    sidecar = path.with_suffix(".pt") if sum(v.numel() for v in present.values()) > LITERAL_LIMIT else None
    text = _render(target, case, check, term, how, data, sidecar, path.name)
    path.write_text(text)
    written = [path]
    if sidecar is not None:
        torch.save({k: v.clone() for k, v in present.items()}, sidecar)
        written.append(sidecar)
    return written


def _call_block(target: Target, case: Case, how: Recipe) -> str:
    """The routine as the script calls it: `routine(mods, *args, **kwargs)`."""
    level = case.level
    if how.call is not None:
        params = inspect.signature(how.call).parameters
        takes = [p for p in ("tp_group", "with_entropy", "chunk_size", "log_prob_keep_mask", "with_entropy_grad")
                 if p in params]
        args = "logits, tokens" if level == "kernel" else "hidden, weight, tokens"
        kwargs = ", ".join(f"{p}={p}" for p in takes)
        return (f"{_source(how.call)}\n\n"
                f"def routine(mods, {args}, tp_group, with_entropy, chunk_size, log_prob_keep_mask, with_entropy_grad):\n"
                f"    \"\"\"The call above, with the routine's own modules ({', '.join(how.files) or 'none'}).\"\"\"\n"
                f"    return {how.call.__name__}(*mods, {args}, {kwargs})\n")
    name = {"kernel": "calculate_log_probs_and_entropy", "linear": "calculate_linear_log_probs_and_entropy"}[level]
    left_out = target.omitted.get(level, frozenset())
    contract = ("with_entropy", "chunk_size", "log_prob_keep_mask", "with_entropy_grad") if level == "kernel" \
        else ("with_entropy", "chunk_size", "with_entropy_grad")
    kwargs = ", ".join(f"{p}={p}" for p in contract if p not in left_out)
    args = "logits, tokens" if level == "kernel" else "hidden, weight, tokens"
    if how.file:
        load = (f"    spec = importlib.util.spec_from_file_location('_repro_routine', {how.file!r})\n"
                f"    module = importlib.util.module_from_spec(spec)\n"
                f"    sys.modules['_repro_routine'] = module\n"
                f"    spec.loader.exec_module(module)\n")
    else:
        load = f"    module = importlib.import_module({how.module!r})\n"
    return (f"def routine(mods, {args}, tp_group, with_entropy, chunk_size, log_prob_keep_mask, with_entropy_grad):\n"
            f"    \"\"\"The routine's own `{name}`, called as the contract says.\"\"\"\n"
            f"{load}"
            f"    return module.{name}({args}, tp_group, {kwargs})\n")


_HEADER = '''#!/usr/bin/env python3
"""{title}

{about}

The case (logprob-harness's spec): {spec}
Run it with {routine_where} on PYTHONPATH, in an environment with torch{needs}:

    python {name}

Exit status: 1 the defect is there (its message printed), 0 it is not, 2 the case could not be run.
Written by `{command}`; it needs nothing of the harness.
"""
import importlib
import importlib.util
import math
import os
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CHECK, TERM, LEVEL = {check!r}, {term!r}, {level!r}
TP, V_LOCAL, T = {tp}, {v_local}, {T}
DTYPE = {dtype}
CHUNK_SIZE, WITH_ENTROPY, WITH_ENTROPY_GRAD = {chunk_size}, {with_entropy}, {with_entropy_grad}
REQUIRES_GRAD = {requires_grad}  # the inputs the caller trains
FROZEN = {frozen!r}  # fused-linear level: the input that requires no grad ("none", "weight", "hidden")
CASE_SPEC = {spec!r}
MEGATRON = {megatron}  # the routine uses megatron-core: its parallel_state is set up as a trainer's process has it
FILES = {files!r}  # the routine's own files, found under an entry of sys.path
HOW = {how!r}
RANK_TIMEOUT_S = 120  # a rank that has not finished by then is stopped (exit 2, or a crash's finding)
inf, nan = math.inf, math.nan


def _t(values, shape, dtype):
    kind = {{"bool": torch.bool, "int64": torch.int64}}.get(dtype)
    if kind is not None:
        return torch.tensor(values, dtype=torch.int64).reshape(shape).to(kind)
    return torch.tensor(values, dtype=torch.float64).reshape(shape).to(getattr(torch, dtype))


'''


def _render(target: Target, case: KernelCase | LinearCase, check: str, term: str, how: Recipe,
            data: dict[str, Any], sidecar: Path | None, name: str) -> str:
    routine = ", ".join(how.files) or (how.module or how.file)
    peer = how.name or (Path(how.file).stem if how.file else target.spec.rpartition(".")[2])
    title = f"{check}{f' ({term} term)' if term else ''} of {peer}'s routine, reproduced with torch and its own code."
    about = textwrap.fill(_ABOUT.get(check, ""), 96)
    needs = " and megatron-core" if how.megatron else ""
    where = how.how or (f"{routine}'s folder" if how.file else f"the module {how.module}'s package")
    parts = [_HEADER.format(
        title=title, about=about, spec=case.spec(), routine_where=where, needs=needs, name=name,
        command=f"python -m harness repro --target {target.spec} '{case.spec()}' --check {check}"
                + (f" --term {term}" if term else "") + " --script FILE.py",
        check=check, term=term, level=case.level, tp=case.tp, v_local=case.v_local, T=case.T,
        dtype=str(_dtype(case)),
        chunk_size=case.chunk_size, with_entropy=case.with_entropy,
        with_entropy_grad=case.with_entropy_grad, requires_grad=case.requires_grad,
        frozen=getattr(case, "frozen", "none"), megatron=how.megatron,
        files={k: list(v) for k, v in how.files.items()}, how=how.how)]
    parts.append("# The case's inputs and the finding's bounds, drawn by the harness from the case's seed "
                 f"({case.seed}).\n# Bounds: the allowed |error| of each entry, from a float32 error analysis "
                 "(logprob-harness's docs/tolerances.md).\n")
    if sidecar is not None:
        parts.append(f"_SAVED = torch.load(Path(__file__).with_name({sidecar.name!r}))\n")
        for key, value in data.items():
            parts.append(f"{key} = _SAVED.get({key!r})\n" if value is not None else f"{key} = None\n")
    else:
        for key, value in data.items():
            parts.append(f"{key} = {_literal(value) if value is not None else 'None'}\n")
    parts.append("\n\n" + _LOADER + "\n\n" + _call_block(target, case, how) + "\n\n" + _REFERENCE)
    parts.append("\n\n# How the harness compares a result with the reference (its own code).\n")
    parts.append(_source(tolerance.compare).replace("tuple[list[str], float | None]", "tuple")
                 .replace("actual: Any", "actual") + "\n\n" + _source(tolerance._mismatch) + "\n")
    if check == "frozen-input-work":
        parts.append("\n\n# The matmul FLOP count of a call (the harness's own counter).\n" + _flops_source())
    parts.append("\n\n" + _RANK + "\n\n" + _JUDGE[check] + "\n\n" + _MAIN)
    return "".join(parts)


def _dtype(case: Case) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[getattr(case, "dtype", "fp32")]


def _flops_source() -> str:
    text = Path(inspect.getfile(matmul_flops)).read_text()
    body = text.split("from torch.utils.flop_counter import FlopCounterMode\n", 1)[1]
    return ("import contextlib\nfrom typing import Any, Callable, Iterator\n\nfrom torch.utils import flop_counter\n"
            "from torch.utils.flop_counter import FlopCounterMode\n" + body)


_ABOUT = {
    "gradients": "The gradient of sum(w1 * log_prob) (+ sum(w2 * entropy) when the entropy is in the loss) "
                 "with respect to the inputs, gathered from every rank's shard, against the float64 gradient "
                 "of the same loss.",
    "values": "The log-probs and the entropy each rank returns, against the float64 values of the same inputs.",
    "finite": "NaN or inf in the outputs or the gradient where the float64 answer is finite.",
    "crash": "Every rank runs the call and its backward without raising.",
    "empty-input": "A call on T == 0 rows returns empty outputs without raising.",
    "frozen-input-work": "With one input frozen (a LoRA run's LM head), the call, forward and backward, runs at "
                         "least half of one gradient product (2*T*V_local*H FLOPs) fewer matmul FLOPs than with "
                         "both inputs trainable: the frozen input's gradient is not computed.",
}

_LOADER = '''def load(name, candidates):
    """The routine's own file, found under an entry of sys.path and loaded alone (its package's
    __init__ may import a whole training stack)."""
    for entry in sys.path:
        for rel in candidates:
            path = Path(entry or ".") / rel
            if path.is_file():
                spec = importlib.util.spec_from_file_location(f"_repro_{name}", path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module
                spec.loader.exec_module(module)
                return module
    sys.exit(f"none of {', '.join(candidates)} under any entry of sys.path: {HOW}")'''

_REFERENCE = '''def reference():
    """The float64 answer: log-probs (masked to the keep mask, the target always kept), entropy of the
    unmasked softmax, and the gradient of the loss, from the closed forms
    d log p_t / dx = onehot_t - softmax(masked x) and dH / dx_j = -(p_j log p_j + p_j H)."""
    out = {}
    if LEVEL == "kernel":
        x = LOGITS.to(torch.float64)
    else:
        h64, w64 = HIDDEN.to(torch.float64), WEIGHT.to(torch.float64)
        x = h64 @ w64.T
    rows = torch.arange(x.shape[0])
    masked = x
    if LEVEL == "kernel" and KEEP_MASK is not None:
        keep = KEEP_MASK.clone()
        keep[rows, TOKENS] = True
        masked = x.masked_fill(~keep, -inf)
    lsm = torch.log_softmax(masked, dim=-1)
    out["log_prob"] = lsm[rows, TOKENS]
    p = torch.softmax(x, dim=-1)
    out["entropy"] = -torch.special.xlogy(p, p).sum(-1)
    onehot = torch.zeros_like(x)
    onehot[rows, TOKENS] = 1.0
    g = torch.zeros_like(x)
    if W_LOG_PROB is not None:
        g = g + W_LOG_PROB.to(torch.float64)[:, None] * (onehot - lsm.exp())
    if W_ENTROPY is not None:
        g = g + W_ENTROPY.to(torch.float64)[:, None] * -(torch.special.xlogy(p, p) + p * out["entropy"][:, None])
    if LEVEL == "kernel":
        out["grad"] = g
    else:
        out["grad"] = g.T @ h64  # the whole head's [V, H]
        out["grad_hidden"] = g @ w64
    return out'''

_RANK = '''def inputs(rank):
    """This rank's inputs, as the caller hands them over: its vocab shard, requiring grad when trained."""
    lo, hi = rank * V_LOCAL, (rank + 1) * V_LOCAL
    if LEVEL == "kernel":
        logits = LOGITS[:, lo:hi].clone().requires_grad_(REQUIRES_GRAD)
        mask = None if KEEP_MASK is None else KEEP_MASK[:, lo:hi].clone()
        return (logits, TOKENS.clone()), mask, [logits]
    hidden = HIDDEN.clone().requires_grad_(REQUIRES_GRAD and FROZEN != "hidden")
    weight = WEIGHT[lo:hi].clone().requires_grad_(REQUIRES_GRAD and FROZEN != "weight")
    return (hidden, weight, TOKENS.clone()), None, [weight, hidden]


def call_and_backward(mods, group, rank, frozen=None):
    """One forward and backward of the routine on this rank's inputs; what it returned and the gradients."""
    global FROZEN
    saved, FROZEN = FROZEN, FROZEN if frozen is None else frozen
    try:
        args, mask, leaves = inputs(rank)
    finally:
        FROZEN = saved
    log_prob, entropy = routine(mods, *args, group, WITH_ENTROPY, CHUNK_SIZE, mask, WITH_ENTROPY_GRAD)
    loss = 0.0
    if W_LOG_PROB is not None and isinstance(log_prob, torch.Tensor) and log_prob.requires_grad:
        loss = (log_prob.reshape(-1) * W_LOG_PROB.to(log_prob.dtype)).sum()
    if W_ENTROPY is not None and isinstance(entropy, torch.Tensor) and entropy.requires_grad:
        loss = loss + (entropy.reshape(-1) * W_ENTROPY.to(entropy.dtype)).sum()
    if isinstance(loss, torch.Tensor):
        loss.backward()
    grads = [None if t.grad is None else t.grad.detach().clone() for t in leaves]
    detach = lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
    return {"log_prob": detach(log_prob), "entropy": detach(entropy), "grads": grads}


def rank_main(rank, port, out_dir):
    """One TP rank: joins the gloo group (and megatron-core's parallel_state), runs the case, saves what it saw."""
    torch.set_num_threads(1)
    result = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP,
                                timeout=timedelta(seconds=RANK_TIMEOUT_S // 2))
        group = dist.group.WORLD
        if MEGATRON:
            try:
                from megatron.core import parallel_state
            except ImportError:
                sys.exit("the routine needs megatron-core: pip install megatron-core")
            try:
                parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, create_gloo_process_groups=False)
            except TypeError:  # a megatron-core without that option
                parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
            group = parallel_state.get_tensor_model_parallel_group()
        mods = [load(name, candidates) for name, candidates in FILES.items()]
        result = run(mods, group, rank)
    except SystemExit as e:
        result = {"setup": str(e)}
    except BaseException as e:  # the routine's failure is the finding's data
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if dist.is_initialized():
        dist.destroy_process_group()'''

_RUN_CALL = '''def run(mods, group, rank):
    return call_and_backward(mods, group, rank)'''

_JUDGE: dict[str, str] = {}
_JUDGE["gradients"] = _RUN_CALL + '''


def judge(results, ref):
    """The gradient of every input the caller trains, gathered from the ranks' shards, against the reference."""
    problems = []
    if LEVEL == "kernel":
        shards = [r["grads"][0] for r in results]
        if any(s is None for s in shards):
            return ["no gradient reached the logits (log_prob is not differentiable)"]
        return compare(torch.cat(shards, dim=-1), ref["grad"], GRAD_BOUND, "grad (all shards)")[0]
    if REQUIRES_GRAD and FROZEN != "weight":
        shards = [r["grads"][0] for r in results]
        if any(s is None for s in shards):
            problems.append("no gradient reached the weight shard")
        else:
            problems += compare(torch.cat(shards, dim=0), ref["grad"], GRAD_BOUND, "weight grad (all shards)")[0]
    if REQUIRES_GRAD and FROZEN != "hidden":
        for rank, r in enumerate(results):
            if r["grads"][1] is None:
                problems.append(f"rank {rank}: no gradient reached the hidden states")
            else:
                problems += compare(r["grads"][1], ref["grad_hidden"], GRAD_HIDDEN_BOUND, f"rank {rank} hidden grad")[0]
    return problems'''
_JUDGE["values"] = _RUN_CALL + '''


def judge(results, ref):
    """Every rank's log-probs and entropy against the reference values."""
    problems = []
    for rank, r in enumerate(results):
        if TERM in ("", "log-prob"):
            problems += compare(r["log_prob"], ref["log_prob"], LOG_PROB_BOUND, f"rank {rank} log_prob")[0]
        if TERM in ("", "entropy") and r["entropy"] is not None and ENTROPY_BOUND is not None:
            problems += compare(r["entropy"], ref["entropy"], ENTROPY_BOUND, f"rank {rank} entropy")[0]
    return problems'''
_JUDGE["finite"] = _RUN_CALL + '''


def judge(results, ref):
    """NaN or inf where the reference is finite: outputs and the gradient."""
    pairs = [("log_prob", results[0]["log_prob"], ref["log_prob"]), ("entropy", results[0]["entropy"], ref["entropy"])]
    if LEVEL == "kernel" and all(r["grads"][0] is not None for r in results):
        pairs.append(("grad", torch.cat([r["grads"][0] for r in results], dim=-1), ref["grad"]))
    problems = []
    for name, got, want in pairs:
        if TERM and name != "grad" and name.replace("_", "-") != TERM:
            continue
        if not isinstance(got, torch.Tensor) or got.numel() != want.numel():
            continue
        bad = torch.isfinite(want) & ~torch.isfinite(got.reshape(want.shape).to(torch.float64))
        if bad.any():
            problems.append(f"{name}: {int(bad.sum())} non-finite entries where the oracle is finite, "
                            f"first at {bad.nonzero()[0].tolist()}")
    return problems'''
_JUDGE["crash"] = _RUN_CALL + '''


def judge(results, ref):
    """Every rank returned without raising (the ranks' errors are the finding)."""
    return []'''
_JUDGE["empty-input"] = _RUN_CALL + '''


def judge(results, ref):
    """T == 0: empty outputs, no error."""
    problems = []
    for rank, r in enumerate(results):
        for key in ("log_prob", "entropy"):
            if isinstance(r[key], torch.Tensor) and r[key].numel():
                problems.append(f"rank {rank}: {key} has {r[key].numel()} elements for T == 0")
    return problems'''
_JUDGE["frozen-input-work"] = '''def run(mods, group, rank):
    """The call's matmul FLOPs with the input frozen and with both trainable, each a call of its own."""
    counts = []
    for frozen in (FROZEN, "none"):
        work = Work()
        with work.counting():
            call_and_backward(mods, group, rank, frozen)
        counts.append(work.total)
    return {"work": counts}


def judge(results, ref):
    """With an input frozen, at least half of one gradient product's FLOPs fewer than with both trainable."""
    H = HIDDEN.shape[1]
    one_product = 2 * T * V_LOCAL * H
    problems = []
    for rank, r in enumerate(results):
        frozen, both = r["work"]
        if frozen is None or both is None or both < 3 * one_product:
            continue
        if both - frozen < one_product // 2:
            problems.append(f"rank {rank}: {frozen:,} matmul FLOPs with the {FROZEN} frozen, {both:,} with "
                            f"both inputs trainable: {both - frozen:,} fewer, where not computing the frozen "
                            f"{FROZEN}'s gradient saves {one_product:,} (2*T*V_local*H; at least half required)")
    return problems'''

_MAIN = '''def main():
    print(f"case: {CASE_SPEC}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        if TP == 1:  # one rank: in this process
            rank_main(0, port, out_dir)
        else:  # a process per TP rank
            ctx = mp.start_processes(rank_main, args=(port, out_dir), nprocs=TP, join=False, start_method="spawn")
            deadline = time.monotonic() + RANK_TIMEOUT_S
            try:
                while not ctx.join(timeout=1.0):
                    if time.monotonic() > deadline:
                        break
            except mp.ProcessExitedException as e:
                print(f"a rank died: {e}")
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        results = []
        for rank in range(TP):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            results.append(torch.load(path, weights_only=False) if os.path.exists(path) else
                           {"error": "the rank did not finish (stopped, or it died)"})
    setup = [r["setup"] for r in results if "setup" in r]
    if setup:
        print(f"could not run the case: {setup[0]}")
        return 2
    errors = [f"rank {rank} exception: {r['error']}" for rank, r in enumerate(results) if "error" in r]
    if errors:
        if CHECK != "crash" and CHECK != "empty-input":
            print("the call raised; this script checks " + CHECK + ":", *errors, sep="\\n  ")
            print(results[0].get("traceback", ""))
            return 2
        problems = errors
    else:
        problems = judge(results, reference() if T else None)
    label = CHECK + (f" ({TERM} term)" if TERM else "")
    if problems:
        print(f"FINDING [{label}]: " + "; ".join(problems))
        for r in results:
            if r.get("traceback"):
                print(r["traceback"])
                break
        return 1
    print(f"PASS [{label}]: no defect on this case")
    return 0


if __name__ == "__main__":
    sys.exit(main())'''
