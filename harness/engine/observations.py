"""What a rank observed while running one case: the only thing ranks send back to the checks.

Ranks record, checks judge. Each field is written in one place (`engine.executor`) and read by the
checks, the reports and the performance gate; a misspelt field is an AttributeError, not a silent
None. Kernel and wrapper cases fill the same fields: a kernel case holds tensors, a wrapper case
one entry per sample.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import torch

from harness.meters.trace import Event

Stage = Literal["none", "forward", "backward"]
Values = Union[torch.Tensor, list[torch.Tensor], None]


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What the checks need of an output tensor besides its values."""
    shape: tuple[int, ...]
    dtype: str  # "float32", "bfloat16", ...
    requires_grad: bool

    @classmethod
    def of(cls, t: Any) -> Optional["TensorMeta"]:
        if not isinstance(t, torch.Tensor):
            return None
        return cls(tuple(t.shape), str(t.dtype).removeprefix("torch."), t.requires_grad)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(slots=True)
class KernelPass:
    """A wrapper case's rows run through the target's own kernel, chunked and unchunked (keys: the
    chunk size, and -1): the collectives of each forward and the memory figures of each call.
    What `chunk-size-honoured` and `memory-chunk-passthrough` compare the wrapper with."""
    traces: dict[int, list[Event]] = field(default_factory=dict)
    memory: dict[int, dict[str, Any]] = field(default_factory=dict)


@dataclass(slots=True)
class Observation:
    stage: Stage = "none"  # the last phase every step of which completed on this rank
    log_prob: Values = None  # kernel: [T] (or [T, 1]); wrapper: per-sample response log-probs
    entropy: Values = None
    log_prob_meta: Union[TensorMeta, list[Optional[TensorMeta]], None] = None
    entropy_meta: Union[TensorMeta, list[Optional[TensorMeta]], None] = None
    grad: Optional[torch.Tensor] = None  # this rank's gradient w.r.t. its logits shard (linear: its weight shard)
    grad_meta: Optional[TensorMeta] = None
    grad_hidden: Optional[torch.Tensor] = None  # linear level: this rank's gradient w.r.t. the hidden states
    grad_hidden_meta: Optional[TensorMeta] = None
    # A two_inputs context: the second call's gradients w.r.t. its own inputs (`Case.second()`).
    grad_2: Optional[torch.Tensor] = None
    grad_hidden_2: Optional[torch.Tensor] = None
    # Distillation level: the top-k's global ids, and the teacher's gradient (a differentiable teacher).
    indices: Optional[torch.Tensor] = None
    indices_meta: Optional[TensorMeta] = None
    grad_teacher: Optional[torch.Tensor] = None
    integrity: list[str] = field(default_factory=list)  # problems with the caller's inputs after the call
    side_effects: list[str] = field(default_factory=list)  # process-global state a call left changed (`state_watch`)
    memory: dict[str, Any] = field(default_factory=dict)  # `meters.memory_meter.Meter.figures`
    # Linear level, a frozen input: the matmul FLOPs of a forward and backward with it frozen, and
    # with both inputs trainable (`executor.frozen_and_trainable_work`).
    work: Optional[tuple[Optional[int], Optional[int]]] = None
    n_forward_collectives: Optional[int] = None  # wrapper: how many of the trace's collectives the forward issued
    kernel_pass: Optional[KernelPass] = None
    # A call without autograd (no_grad, inference_mode): the outputs of the same call on the
    # training path, (log_prob, entropy), which it must equal bit for bit.
    training: Optional[tuple[Values, Values]] = None
    # Wrapper level: the routine asked megatron-core's parallel_state for its context-parallel
    # group, rank or size (`executor.cp_queries`): it implements CP, whatever its capabilities say.
    cp_queried: bool = False
    # The routine's warnings that the user's warnings filters turn into errors (`engine.warnings_seen`),
    # each "Category at file:line: message".
    warnings: list[str] = field(default_factory=list)
    step_refused: str = ""  # the output the harness's loss step could not use (HARNESS_STEP), by its key
    traceback: str = ""


HANG_KINDS = ("stuck", "timeout")  # a rank that never answered: blocked in a collective, or past the deadline
HARNESS_STEP = "harness-step"  # the harness's own step could not use the routine's output: no crash of the routine


@dataclass(slots=True)
class RankResult:
    rank: int
    error: Optional[str] = None
    error_kind: Optional[str] = None  # "exception", "timeout", "died", "stuck", "mismatch", HARNESS_STEP
    trace: list[Event] = field(default_factory=list)
    obs: Observation = field(default_factory=Observation)
    replica: int = 0  # the data-parallel replica whose TP group this rank is in (`rank` is the TP rank)
    cp_rank: int = 0  # the context-parallel rank whose TP group this rank is in
    groups: tuple[int, int] = (1, 1)  # (CP size, DP size) of the world: how many TP groups it has
    # A rank that died (the pool's own result): its process's exit status, negative for the signal
    # that ended it, and how many jobs the process had been sent, this one included.
    exit_code: Optional[int] = None
    call: int = 0

    @property
    def group_name(self) -> str:
        """Which TP group of the world this rank is in ("replica 1, cp 0"); "" in a world of one."""
        cp, dp = self.groups
        return ", ".join(([f"replica {self.replica}"] if dp > 1 else []) + ([f"cp {self.cp_rank}"] if cp > 1 else []))

    @property
    def name(self) -> str:
        """The rank as messages name it: its TP rank and, where the world has more than one TP group,
        which group: "rank 1 (cp 0, tp 1)", "rank 0 (replica 1, tp 0)"."""
        group = self.group_name
        return f"rank {self.rank} ({group}, tp {self.rank})" if group else f"rank {self.rank}"

    @classmethod
    def from_exception(cls, rank: int, e: BaseException) -> "RankResult":
        """An exception raised on a rank, as the result that rank reports (never re-raised)."""
        result = cls(rank, error=f"{type(e).__name__}: {e}".strip()[:2000], error_kind="exception")
        result.obs.traceback = traceback.format_exc(limit=8)[-4000:]
        return result
