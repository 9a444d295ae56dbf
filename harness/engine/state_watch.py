"""The process-global state a trainer relies on, watched around every call and backward on a rank.

A routine runs inside the trainer's process: a default dtype it leaves at float64, grad mode it
leaves off, a thread count it changes or a draw from the global RNG (which shifts the trainer's
dropout stream) is a defect of the routine even when every number it returns is right. Each
watched window (`watched("kernel forward")`, `watched("backward")`) takes a snapshot before and
after; a difference is recorded as a finding (the setting, its values before and after, the
window) and the state is put back at once, so that the rest of the case, later cases in the same
worker process and the other checks see the state the case began with. A routine that restores
what it changed (RNG use inside `torch.random.fork_rng`, a `set_default_dtype` undone before it
returns) leaves no difference and no finding. docs/side-effects.md lists the settings and why.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, cast

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Setting:
    name: str  # as findings name it
    get: Callable[[], Any]
    set: Callable[[Any], object] | None  # None: cannot be put back in this process (the finding says so)
    why: str = ""  # what a trainer loses, said once in the finding
    fmt: Callable[[Any], str] = repr


def _default_group() -> Any:
    """The default process group's identity: None when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.distributed_c10d._get_default_group()


def _fmt_group(g: Any) -> str:
    return "not initialised" if g is None else f"{type(g).__name__} of {g.size()} ranks at {id(g):#x}"


_held_inference: list[Any] = []  # guards that keep inference mode off after a routine left it on


def _state_tensor(state: bytes) -> torch.Tensor:
    # A generator's state is kept as bytes: a snapshot is then compared at the speed of bytes.
    return torch.frombuffer(bytearray(state), dtype=torch.uint8)


def _set_inference_mode(on: bool) -> None:
    # Inference mode is thread-local state set by an RAII guard, with no plain setter: a guard is
    # created and kept, which sets it for this thread from now on.
    _held_inference.append(torch._C._InferenceMode(on))


def _set_deterministic(mode: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])


# The precision settings of float32 matmuls and convolutions: the legacy global one and, in torch
# >= 2.9, one per (backend, op) (`torch.backends.<backend>[.<op>].fp32_precision`; the legacy
# allow_tf32 flags are views of them), read through torch's own accessor, without the attribute
# machinery around it. One setting, for one call changes several at once.
_PER_BACKEND = (("generic", "all"), ("cuda", "matmul"), ("cuda", "all"), ("cuda", "conv"), ("cuda", "rnn"),
                ("mkldnn", "all"), ("mkldnn", "matmul"), ("mkldnn", "conv"), ("mkldnn", "rnn"))
_PER_BACKEND_NAMES = tuple(f"fp32_precision({b}, {o})" for b, o in _PER_BACKEND)
_get_precision = getattr(torch._C, "_get_fp32_precision_getter", None)
# The reduced-precision reductions of float16/bfloat16 matmuls, read through torch's accessors.
_REDUCTIONS = tuple((n, getattr(torch._C, f"_get_cublas_allow_{n}"), getattr(torch._C, f"_set_cublas_allow_{n}"))
                    for n in ("fp16_reduced_precision_reduction", "bf16_reduced_precision_reduction")
                    if hasattr(torch._C, f"_get_cublas_allow_{n}"))


def _precision() -> tuple[tuple[str, Any], ...]:
    try:
        legacy: Any = torch.get_float32_matmul_precision()
    except RuntimeError:  # raises once the legacy and the per-backend settings were both used
        legacy = "unreadable (legacy and per-backend settings mixed)"
    per_backend = (tuple(zip(_PER_BACKEND_NAMES, [_get_precision(b, o) for b, o in _PER_BACKEND], strict=True))
                   if _get_precision is not None else (("allow_tf32", torch.backends.cuda.matmul.allow_tf32),))
    return (("float32_matmul_precision", legacy), *per_backend, *((f"allow_{n}", get()) for n, get, _ in _REDUCTIONS))


def _set_precision(value: tuple[tuple[str, Any], ...]) -> None:
    settings = dict(value)
    legacy = settings.pop("float32_matmul_precision")
    if not legacy.startswith("unreadable"):
        torch.set_float32_matmul_precision(legacy)  # first: it sets the per-backend ones too
    if _get_precision is not None:
        for key, name in zip(_PER_BACKEND, _PER_BACKEND_NAMES, strict=True):
            torch._C._set_fp32_precision_setter(*key, settings[name])
    else:
        torch.backends.cuda.matmul.allow_tf32 = settings["allow_tf32"]
    for n, _, set_ in _REDUCTIONS:
        value = settings[f"allow_{n}"]
        if isinstance(value, tuple):  # (allowed, allowed with split-K), in torch >= 2.7
            set_(*value)
        else:
            set_(value)


def _default_device() -> Any:
    # What torch.set_default_device set (None: none), read where it keeps it: get_default_device()
    # walks the function-mode stack and costs more than every other setting together.
    return getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None) and \
        torch._GLOBAL_DEVICE_CONTEXT.device_context.device


def _cpu_settings() -> list[Setting]:
    out = [
        Setting("default dtype", torch.get_default_dtype, torch.set_default_dtype,
                "every tensor the trainer creates afterwards without a dtype takes it"),
        Setting("default device", _default_device if hasattr(torch, "_GLOBAL_DEVICE_CONTEXT") else torch.get_default_device,
                torch.set_default_device, "every tensor the trainer creates afterwards without a device goes there",
                lambda d: "none set" if d is None else repr(d)),
        Setting("grad mode", torch.is_grad_enabled, torch.set_grad_enabled,
                "the trainer's next forward builds no graph"),
        Setting("inference mode", torch.is_inference_mode_enabled, _set_inference_mode),
        Setting("anomaly mode", lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
                lambda v: torch.set_anomaly_enabled(*v)),
        Setting("intra-op threads", torch.get_num_threads, torch.set_num_threads,
                "every later op of the trainer runs on that many threads"),
        # Settable once per process, before any parallel work: a routine cannot change it without
        # raising, but a finding that names it is cheaper than a puzzle if one ever does.
        Setting("inter-op threads", torch.get_num_interop_threads, None),
        Setting("deterministic algorithms",
                lambda: (torch.are_deterministic_algorithms_enabled(),
                         torch.is_deterministic_algorithms_warn_only_enabled()), _set_deterministic),
        Setting("CPU RNG state", lambda: torch.get_rng_state().numpy().tobytes(),
                lambda v: torch.set_rng_state(_state_tensor(v)),
                "the global generator advanced: a trainer's dropout and sampling stream shifts with the "
                "routine's settings; draw inside torch.random.fork_rng() or from a torch.Generator of its own"),
    ]
    out.append(Setting("matmul precision", _precision, _set_precision,
                       "the trainer's float32 matmuls and convolutions run at that precision"))
    cudnn = torch.backends.cudnn
    out += [Setting(f"torch.backends.cudnn.{n}", lambda n=n: getattr(cudnn, n), lambda v, n=n: setattr(cudnn, n, v))
            for n in ("deterministic", "benchmark")]
    out.append(Setting("torch.distributed default group", _default_group, None,
                       "the trainer's collectives ran on that group", _fmt_group))
    return out


def _cuda_settings() -> list[Setting]:
    return [
        Setting("current CUDA device", torch.cuda.current_device, torch.cuda.set_device),
        Setting("current CUDA stream", torch.cuda.current_stream, torch.cuda.set_stream,
                "the trainer's next kernels are queued on that stream"),
        Setting("CUDA RNG state", lambda: torch.cuda.get_rng_state().numpy().tobytes(),
                lambda v: torch.cuda.set_rng_state(_state_tensor(v)),
                "the device generator advanced: a trainer's dropout stream shifts"),
    ]


def settings(device: torch.device) -> list[Setting]:
    return _cpu_settings() + (_cuda_settings() if device.type == "cuda" else [])


class Watch:
    """The windows of one case on one rank: the findings its calls left, each said once."""

    def __init__(self, device: torch.device, level: str):
        self.settings, self.level = settings(device), level
        self.getters = tuple(s.get for s in self.settings)
        self.findings: list[str] = []

    def snapshot(self) -> list[Any]:
        return [get() for get in self.getters]

    @contextlib.contextmanager
    def window(self, what: str) -> Iterator[None]:
        before = self.snapshot()
        try:
            yield
        finally:
            after = self.snapshot()
            if before != after:  # plain values: one comparison in C for the common case
                self._record_and_restore(what, before, after)

    def _record_and_restore(self, what: str, before: list[Any], after: list[Any]) -> None:
        for s, b, a in zip(self.settings, before, after, strict=True):
            if b == a:
                continue
            if s.set is None:
                done = "cannot be restored in this process"
            else:
                try:
                    s.set(b)
                    done = "restored by the harness"
                except Exception as e:  # noqa: BLE001 - a setting that refuses is reported, not raised
                    done = f"could not be restored ({type(e).__name__}: {e})"
            change = "changed" if isinstance(b, bytes) else f"{s.fmt(b)} -> {s.fmt(a)}"
            if s.name == "matmul precision":
                change = ", ".join(f"{n} {v!r} -> {w!r}" for (n, v), (_, w) in zip(cast(tuple, b), cast(tuple, a), strict=True)
                                   if v != w)  # (setting, value) pairs
            why = f"; {s.why}" if s.why else ""
            msg = f"{s.name} {change} after the {what} and not restored by the routine{why} ({done})"
            if msg not in self.findings:
                self.findings.append(msg)


_active: Watch | None = None


@contextlib.contextmanager
def watching(device: torch.device, level: str) -> Iterator[Watch]:
    """The watch of one case on this rank: every `watched` window inside it reports to it."""
    global _active
    previous, _active = _active, Watch(device, level)
    try:
        yield _active
    finally:
        _active = previous


def watched(what: str) -> Any:
    """A window around one call or backward ("kernel forward", "backward"); nothing outside a
    case's watch (a timing job's calls are timed bare)."""
    return _active.window(what) if _active is not None else contextlib.nullcontext()
