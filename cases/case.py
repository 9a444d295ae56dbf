"""Case descriptions: small frozen dataclasses whose tensors are rebuilt from a seed.

A case is cheap to pickle (it crosses to every rank) and its inputs are a pure function of its
fields, so the main process (oracle) and every rank (shard) see the same values.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MASKS = ("none", "random", "drop_target", "only_target")
TOP_P = ("none", "nucleus", "partial")
LOSS_TERMS = ("both", "log_prob", "entropy")
# How the caller lays out the logits it hands over (the values are the same in every layout; only
# the memory differs): a fresh contiguous leaf; a transposed view (Megatron's [s, b, v] output
# turned into [b, s, v]); every other row of a buffer; every other column; a row slice of a
# larger buffer (a storage offset, as the wrapper's per-sample slices have); the output of an op
# (a non-leaf, as in training: an in-place write corrupts the graph instead of raising).
LAYOUTS = ("contiguous", "transposed", "row_strided", "col_strided", "offset", "nonleaf")
NONCONTIGUOUS = ("transposed", "row_strided", "col_strided")
TOKEN_LAYOUTS = ("contiguous", "strided", "offset")  # int64 always; a view or a slice of a buffer
# How the routine is called: the training path; under torch.no_grad() or torch.inference_mode()
# (old-policy / reference log-probs); two microbatches accumulated into the same .grad (two
# calls, two backwards); two calls in one graph whose losses are summed (one backward); two calls
# in one graph on different inputs (two microbatches, or policy and reference rows, in one loss:
# the second call's inputs are `Case.second()`'s, so state a routine keeps beside itself instead of
# on ctx is overwritten by the second call and shows in the first call's gradient).
CONTEXTS = ("train", "no_grad", "inference_mode", "accumulate", "two_calls", "two_inputs")
AUTOGRAD_OFF = ("no_grad", "inference_mode")
# Context parallelism (docs/contract.md): how the packed sequence's rows are spread over the CP ranks.
CP_LAYOUTS = ("zigzag", "allgather")
TWO_CALLS = ("accumulate", "two_calls")
LINEAR_CONTEXTS = ("train", "two_inputs")  # the fused-linear level runs on the training path only
# Which input of a fused-linear case is frozen (requires no grad): neither; the LM head (LoRA,
# adapters); the hidden states (a frozen trunk under a trained head).
FROZEN = ("none", "weight", "hidden")
# How a fused-linear caller hands over its hidden states (the values are the same in every view; only
# the memory differs): a contiguous [T, H] leaf; `shifted`, the first T positions of a [1, T + 1, H]
# decoder output (the caller's `h[:, :-1]`: a storage with a spare row after the view); `seq_first`,
# one batch element of Megatron's sequence-first [T, 2, H] activation (`act.transpose(0, 1)[1]`: rows
# 2H apart, a storage offset). The caller's tensor is the buffer (a leaf); the routine gets the view.
HIDDEN_VIEWS = ("contiguous", "shifted", "seq_first")
SECOND_SEED_STRIDE = 7_368_787  # the second call's seed in a two_inputs context (not a replica's)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _peaked(g: torch.Generator, x: torch.Tensor) -> torch.Tensor:
    """One confident entry per row: where uniform inputs hide padding and max-subtraction bugs."""
    rows, vocab = x.shape
    spike = torch.randint(0, vocab, (rows,), generator=g)
    x[torch.arange(rows), spike] += 12.0 + 6.0 * torch.rand(rows, generator=g, dtype=torch.float64)
    return x


def _far_tail(g: torch.Generator, x: torch.Tensor) -> torch.Tensor:
    """About half of each row's entries 50 to 110 below the rest, its largest entry kept among the
    rest: log-probs from about -50 to -115, where float32's own floors are (its smallest normal's log
    is -87, its smallest subnormal's -103) and where `log(p + eps)` (eps 1e-10 floors at -23, 1e-20
    at -46) or a clamp of the log-probs or logits is wrong. The answer `x_t - lse` is an ordinary
    float32 number there: nothing in the contract's arithmetic floors it."""
    rows, vocab = x.shape
    far = torch.rand(rows, vocab, generator=g) < 0.5
    if vocab:
        far[torch.arange(rows), x.argmax(-1)] = False
    depth = 50.0 + 60.0 * torch.rand(rows, vocab, generator=g, dtype=torch.float64)
    return torch.where(far, x - depth, x)


# The logits regimes of the kernel and wrapper levels, one entry each: how a row of N(0, 1) logits
# (drawn first, from the case's generator) is turned into the regime's. `REGIMES` lists them.
LOGIT_REGIMES: dict[str, Callable[[torch.Generator, torch.Tensor], torch.Tensor]] = {
    "normal": lambda g, x: x,
    "peaked": _peaked,
    "huge": lambda g, x: (x * 1.0e4).clamp(-3.0e4, 3.0e4),  # stays finite in fp16
    "ties": lambda g, x: torch.randint(0, 3, x.shape, generator=g).to(torch.float64),
    "neginf": lambda g, x: x.masked_fill(torch.rand(x.shape, generator=g) < 0.3, -math.inf),
    "fartail": _far_tail,
}
REGIMES = tuple(LOGIT_REGIMES)


def _logits(g: torch.Generator, rows: int, vocab: int, regime: str, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    return LOGIT_REGIMES[regime](g, x).to(dtype)


@dataclass(frozen=True)
class KernelInputs:
    logits: torch.Tensor  # [T, V], case dtype
    tokens: torch.Tensor  # [T] int64
    keep_mask: torch.Tensor | None  # [T, V] bool
    w_log_prob: torch.Tensor | None  # [T] float32 upstream weights; None: not in the loss
    w_entropy: torch.Tensor | None
    # The second call's upstream weights (contexts with two calls); the gradient is linear in
    # the weights, so the expected gradient is the oracle's at the summed weights.
    w_log_prob_2: torch.Tensor | None = None
    w_entropy_2: torch.Tensor | None = None

    def total_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return _plus(self.w_log_prob, self.w_log_prob_2), _plus(self.w_entropy, self.w_entropy_2)


def _plus(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return a if a is None or b is None else a + b


@dataclass(frozen=True)
class WrapperInputs:
    logits: torch.Tensor  # [T, V], case dtype (the wrapper adds the batch dim)
    unconcat_tokens: list[torch.Tensor]
    top_p_token_ids: list[torch.Tensor | list[int]] | None  # per sample, slime's encoding (docs/contract.md)
    top_p_token_offsets: list[torch.Tensor | list[int]] | None
    w_log_probs: list[torch.Tensor]
    w_entropy: list[torch.Tensor]
    w_log_probs_2: list[torch.Tensor] | None = None  # the second call's (contexts with two calls)
    w_entropy_2: list[torch.Tensor] | None = None

    def total_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self.w_log_probs_2 is None:
            return self.w_log_probs, self.w_entropy
        assert self.w_entropy_2 is not None  # the second call's weights come as a pair
        return ([a + b for a, b in zip(self.w_log_probs, self.w_log_probs_2, strict=True)],
                [a + b for a, b in zip(self.w_entropy, self.w_entropy_2, strict=True)])


REPLICA_SEED_STRIDE = 1_000_003


def choice(default: str, values: tuple[str, ...] | dict[str, Any]) -> Any:
    """A case field whose value is one of `values` (a tuple of this module, the one place they are
    listed): a case, and so a spec, with any other value is refused, saying which are valid, and
    `python -m harness fields` lists them."""
    return dataclasses.field(default=default, metadata={"values": tuple(values)})


def valid_values(cls: type) -> dict[str, tuple[str, ...]]:
    """The fields of a case class that take one of a fixed set of values, and those values."""
    return {f.name: f.metadata["values"] for f in dataclasses.fields(cls) if "values" in f.metadata}


# Every case class by its level's name (`parse_case`): a class registers itself by being defined.
CASE_TYPES: dict[str, type] = {}


class CaseBase:
    level: ClassVar[str]
    # What every level's dataclass declares, named for the type checker: the annotations of a base
    # that is not itself a dataclass make no fields.
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
    tp: int
    v_local: int
    seed: int
    context: str
    chunk_size: int
    with_entropy: bool
    later_fields: ClassVar[frozenset[str]] = frozenset()  # this level's own fields added later (`spec`)
    # The capability a routine declares to take half-precision inputs beyond its contract's float32
    # ones (None: the contract's dtypes are the case's).
    half_precision_capability: ClassVar[str | None] = None
    # The capability a chunk size that splits the rows asks for, at a level whose callers are
    # configured with one (the wrapper's `args.log_probs_chunk_size`); None: the size is a knob any
    # routine may ignore.
    chunk_capability: ClassVar[str | None] = None

    if TYPE_CHECKING:
        @property
        def expects_entropy_grad(self) -> bool: ...

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "level" in cls.__dict__:
            CASE_TYPES[cls.level] = cls

    def __post_init__(self) -> None:
        for name, allowed in valid_values(type(self)).items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r} for {self.level} cases; "
                                 f"valid: {', '.join(allowed)}")

    def spec(self) -> str:
        """Stable one-line form; `parse_case(spec)` rebuilds the case. Fields added after the first
        release are left out at their default, so earlier specs (and baselines keyed by them) stay."""
        later = _LATER_FIELDS | self.later_fields
        parts = [f"{f.name}={fmt_field(getattr(self, f.name))}" for f in dataclasses.fields(self)
                 if f.name not in later or getattr(self, f.name) != f.default]
        return f"{self.level}:" + ",".join(parts)

    def replica(self, d: int):
        """What DP replica `d` of this case computes: the same shapes and settings on other data
        (replica 0 is the case itself), so a reduction that crosses replicas corrupts the answer."""
        if d == 0:
            return self
        return dataclasses.replace(self, seed=(self.seed + d * REPLICA_SEED_STRIDE) % 2**31)

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)

    def second(self):
        """The second call's case in a two_inputs context: the same shapes and settings on other
        inputs (another seed), on the training path; its own oracle is the second call's answer."""
        return dataclasses.replace(self, context="train", seed=(self.seed + SECOND_SEED_STRIDE) % 2**31)

    @property
    def vocab(self) -> int:
        return self.tp * self.v_local

    @property
    def autograd(self) -> bool:
        """The call runs with autograd on (not under no_grad / inference_mode)."""
        return self.context not in AUTOGRAD_OFF

    def config(self) -> str:
        """The configuration a bitwise property is reported for."""
        masked = "masked" if getattr(self, "mask", "none") != "none" or getattr(self, "top_p", "none") != "none" \
            else "unmasked"
        return (f"{self.level} tp{self.tp} {getattr(self, 'dtype', 'fp32')} "
                f"{'chunked' if self.chunk_size > 0 else 'unchunked'} {masked}")

    @property
    def entropy_mode(self) -> str:
        """What the entropy costs: "log-prob only", "metric-only entropy" or "differentiable entropy"."""
        if not self.with_entropy:
            return "log-prob only"
        return "differentiable entropy" if self.expects_entropy_grad else "metric-only entropy"


@dataclass(frozen=True)
class KernelCase(CaseBase):
    tp: int
    T: int
    v_local: int
    dtype: str = choice("fp32", DTYPES)
    regime: str = choice("normal", REGIMES)
    chunk_size: int = -1
    mask: str = choice("none", MASKS)
    with_entropy: bool = True
    with_entropy_grad: bool = True
    requires_grad: bool = True
    loss_terms: str = choice("both", LOSS_TERMS)  # which outputs the upstream loss uses
    seed: int = 0
    dp: int = 1  # data-parallel replicas: the TP group is a subgroup of a world of tp x dp ranks
    layout: str = choice("contiguous", LAYOUTS)  # the memory layout of the logits handed over
    token_layout: str = choice("contiguous", TOKEN_LAYOUTS)
    context: str = choice("train", CONTEXTS)  # how the routine is called
    # Rows [row_start, row_start + T) of the batch of `batch_of` rows the seed draws (0: the batch
    # is this case's T rows): a row's values then do not depend on which rows are run with it.
    batch_of: int = 0
    row_start: int = 0
    repeat: int = 0  # the n-th identical run of the same call (determinism); changes no input
    level: ClassVar[str] = "kernel"

    @property
    def grad_on(self) -> bool:
        """The outputs can carry autograd history: the logits require grad and autograd is on."""
        return self.requires_grad and self.autograd

    @property
    def expects_entropy_grad(self) -> bool:
        return self.with_entropy and self.with_entropy_grad and self.grad_on

    @property
    def has_backward(self) -> bool:
        """The upstream loss reaches the logits through at least one differentiable output."""
        return self.grad_on and (self.loss_terms != "entropy" or self.expects_entropy_grad)

    @property
    def loss_takes_every_output(self) -> bool:
        """There is a backward and every differentiable output is in its loss (an output left out
        keeps its own graph alive, legitimately, as long as it lives)."""
        return self.has_backward and (self.loss_terms == "both" or not self.expects_entropy_grad)

    def second(self) -> "KernelCase":
        """The second call's case in a two_inputs context: the next T rows of a batch of 2T drawn
        from the same seed (a second microbatch), so that its tokens differ from the first call's
        too (the first rows of a draw are the shard-edge ids), on the training path."""
        if self.batch_of:
            return super().second()
        return self.replace(context="train", batch_of=2 * self.T, row_start=self.T)

    def rows_of_batch(self, start: int, count: int, **changes: Any) -> "KernelCase":
        """The case that runs rows [start, start + count) of this case's batch, alone."""
        batch = self.batch_of or self.T
        return self.replace(T=count, batch_of=batch, row_start=self.row_start + start, **changes)

    def group(self) -> str:
        """Readable id of the configuration family, used in test ids and summaries."""
        dp = f"-dp{self.dp}" if self.dp > 1 else ""
        return f"{self.level}-tp{self.tp}{dp}-{self.dtype}-{'masked' if self.mask != 'none' else 'unmasked'}"

    def inputs(self) -> KernelInputs:
        if self.batch_of:
            full = self.replace(T=self.batch_of, batch_of=0, row_start=0).inputs()
            rows = slice(self.row_start, self.row_start + self.T)
            pick = lambda t: None if t is None else t[rows].clone()  # noqa: E731
            return dataclasses.replace(full, **{f.name: pick(getattr(full, f.name)) for f in dataclasses.fields(full)})
        g = _generator(self.seed)
        T, V = self.T, self.vocab
        logits = _logits(g, T, V, self.regime, DTYPES[self.dtype])
        tokens = torch.randint(0, V, (T,), generator=g)
        # The first and last id of every shard, for every TP layout of this vocab: where offset and
        # boundary bugs live. Independent of self.tp, so the same global case at another TP size
        # (tp-invariance) sees the same tokens.
        edges = sorted({i for k in (1, 2, 4, 8) if V % k == 0 for r in range(k)
                        for i in (r * (V // k), (r + 1) * (V // k) - 1)})
        n = min(T, len(edges))
        tokens[:n] = torch.tensor(edges[:n], dtype=torch.int64)
        if self.regime == "neginf" and T:
            # A -inf target makes log p = -inf by definition; keep targets finite so values compare.
            rows = torch.arange(T)
            logits[rows, tokens] = torch.randn(T, generator=g).to(logits.dtype)
        keep = None
        if self.mask != "none":
            keep = torch.rand(T, V, generator=g) < 0.5
            if self.mask == "drop_target" and T:
                keep[torch.arange(T), tokens] = False
            elif self.mask == "only_target":
                keep[:] = False
        w1 = torch.randn(T, generator=g)
        w2 = torch.randn(T, generator=g)
        second = (torch.randn(T, generator=g), torch.randn(T, generator=g)) if self.context in TWO_CALLS \
            else (None, None)
        # A loss that leaves one output out gives it no upstream gradient (slime #2158's trigger).
        lp, ent = self.loss_terms != "entropy", self.loss_terms != "log_prob"
        return KernelInputs(logits, tokens, keep, w1 if lp else None, w2 if ent else None,
                            second[0] if lp else None, second[1] if ent else None)


@dataclass(frozen=True)
class WrapperCase(CaseBase):
    tp: int
    v_local: int
    total_lengths: tuple[int, ...]
    response_lengths: tuple[int, ...]
    entropy_coef: float | None = None  # None: the attribute is absent from args
    temperature: float | None = None  # None: absent, meaning 1.0
    chunk_size: int = -1
    with_entropy: bool = True
    top_p: str = choice("none", TOP_P)
    regime: str = choice("normal", REGIMES)
    seed: int = 0
    dp: int = 1  # data-parallel replicas: the TP group is a subgroup of a world of tp x dp ranks
    layout: str = choice("contiguous", LAYOUTS)  # of the [T, V_local] rows (the wrapper gets them unsqueezed)
    # "offset"/"strided": every sample's tokens are a slice of one buffer
    token_layout: str = choice("contiguous", TOKEN_LAYOUTS)
    context: str = choice("train", CONTEXTS)
    repeat: int = 0  # the n-th identical run of the same call (determinism); changes no input
    # Context parallelism: `cp` ranks share the packed sequence (laid out as `cp_layout` says); the
    # world is TP x CP x DP. `T` stays the whole sequence's rows, drawn alike at every CP size.
    cp: int = 1
    cp_layout: str = choice("zigzag", CP_LAYOUTS)
    # The logits' dtype: float32 as the contract has them; bf16 or fp16 for a wrapper that declares it
    # takes them (`HARNESS_CAPABILITIES["wrapper_half_precision"]`, as NeMo-RL's packed log-probs do).
    dtype: str = choice("fp32", DTYPES)
    level: ClassVar[str] = "wrapper"
    later_fields: ClassVar[frozenset[str]] = frozenset({"dtype"})
    # Half-precision logits are beyond the contract here: a routine takes them where it declares this.
    half_precision_capability: ClassVar[str | None] = "wrapper_half_precision"
    # A caller without a chunk-size setting (`HARNESS_CAPABILITIES["chunk_size"]` False) runs unchunked.
    chunk_capability: ClassVar[str | None] = "chunk_size"

    @property
    def T(self) -> int:
        return sum(self.total_lengths)

    @property
    def expects_entropy_grad(self) -> bool:
        """PR #2153's rule (whatever the context: under no_grad nothing carries a gradient anyway)."""
        coef = 0.0 if self.entropy_coef is None else self.entropy_coef
        return self.with_entropy and coef != 0

    @property
    def loss_takes_every_output(self) -> bool:
        """A backward from response rows, whose loss takes every differentiable output."""
        return sum(self.response_lengths) > 0 and self.grad_on

    @property
    def grad_on(self) -> bool:
        return self.autograd

    def group(self) -> str:
        dp = f"-dp{self.dp}" if self.dp > 1 else ""
        cp = f"-cp{self.cp}{self.cp_layout}" if self.cp > 1 else ""
        dtype = f"-{self.dtype}" if self.dtype != "fp32" else ""
        return f"{self.level}-tp{self.tp}{cp}{dp}{dtype}-{'topp' if self.top_p != 'none' else 'plain'}"

    def cp_filler(self, cp_rank: int, rows: int) -> torch.Tensor:
        """Finite logits `[rows, V]` in the case's dtype for CP rank `cp_rank`'s padding rows (no sample's row):
        drawn from the seed, so every TP rank of that CP rank holds its shard of the same rows."""
        g = _generator((self.seed * 31 + cp_rank + 1) % 2**31)
        return torch.randn(rows, self.vocab, generator=g, dtype=torch.float64).to(DTYPES[self.dtype])

    @property
    def kernel_comparable(self) -> bool:
        """Chunked and without top-p: the rows can be run through the kernel alone, as the wrapper
        should run them, for the chunk-size checks to compare with."""
        return self.chunk_size > 0 and self.top_p == "none" and self.T > 0

    @property
    def allgather_cp(self) -> bool:
        return self.cp > 1 and self.cp_layout == "allgather"

    def args(self) -> SimpleNamespace:
        args = SimpleNamespace(log_probs_chunk_size=self.chunk_size, allgather_cp=self.allgather_cp)
        if self.entropy_coef is not None:
            args.entropy_coef = self.entropy_coef
        if self.temperature is not None:
            args.rollout_temperature = self.temperature
        return args

    def inputs(self) -> WrapperInputs:
        g = _generator(self.seed)
        V = self.vocab
        logits = _logits(g, self.T, V, self.regime, torch.float32).to(DTYPES[self.dtype])
        tokens = [torch.randint(0, V, (L,), generator=g) for L in self.total_lengths]
        ids: list[Any] | None = None
        offsets: list[Any] | None = None
        if self.top_p != "none":
            ids, offsets = [], []
            for R in self.response_lengths:
                sizes = torch.randint(1, V + 1, (R,), generator=g)
                if self.top_p == "partial":
                    # An empty recorded nucleus: the row keeps only its target (log-prob 0).
                    sizes = sizes * (torch.rand(R, generator=g) < 0.5)
                kept = [torch.randperm(V, generator=g)[: int(k)].sort().values for k in sizes]
                offs = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
                flat = torch.cat(kept) if kept else torch.zeros(0, dtype=torch.int64)
                if self.top_p == "partial":
                    # No recorded nucleus past the offsets' end: a short list, possibly [0] or [].
                    recorded = int(torch.randint(-1, R + 1, (1,), generator=g))
                    offs = offs[: recorded + 1]
                    flat = flat[: int(offs[-1])] if offs.numel() else flat[:0]
                # Both encodings slime takes: int32 tensors (as a rollout batch carries them) or lists.
                if bool(torch.rand(1, generator=g) < 0.5):
                    ids.append(flat.tolist())
                    offsets.append(offs.tolist())
                else:
                    ids.append(flat.to(torch.int32))
                    offsets.append(offs.to(torch.int32))
        w1 = [torch.randn(R, generator=g) for R in self.response_lengths]
        w2 = [torch.randn(R, generator=g) for R in self.response_lengths]
        if self.context not in TWO_CALLS:
            return WrapperInputs(logits, tokens, ids, offsets, w1, w2)
        w1b = [torch.randn(R, generator=g) for R in self.response_lengths]
        w2b = [torch.randn(R, generator=g) for R in self.response_lengths]
        return WrapperInputs(logits, tokens, ids, offsets, w1, w2, w1b, w2b)


LINEAR_REGIMES = ("normal", "peaked", "wide")
# The deep-accumulation regime's data (`cases.strategies.DEEP`): hidden-state channels with a
# non-zero mean and loss weights of one sign (SFT's mean NLL, a response's GRPO advantage), so the
# terms of dW = sum_t G_t^T h_t drift over the rows instead of cancelling (docs/tolerances.md).
DRIFT = "drift"
LINEAR_CASE_REGIMES = LINEAR_REGIMES + (DRIFT,)  # every regime a linear case may name
# The spread of the logits hidden @ weight.T per regime: O(1) to O(10), as a trained LM head's are.
_LINEAR_SCALE = {"normal": 2.0, "peaked": 2.0, "wide": 8.0, DRIFT: 2.0}
_LINEAR_SPIKE = 14.0  # a peaked row's confident logit stands this far above the rest (cf. `_logits`)


@dataclass(frozen=True)
class LinearInputs:
    hidden: torch.Tensor  # [T, H], case dtype, replicated on every TP rank
    weight: torch.Tensor  # [V, H], case dtype: the full LM head; rank r holds rows [r*V_local, (r+1)*V_local)
    tokens: torch.Tensor  # [T] int64
    w_log_prob: torch.Tensor | None
    w_entropy: torch.Tensor | None

    def total_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.w_log_prob, self.w_entropy


@dataclass(frozen=True)
class LinearCase(CaseBase):
    """A fused-linear case (docs/fused-linear.md): hidden states [T, H] and the LM head's vocab
    shard [V_local, H] in, log-probs and entropy out. Called on the training path only, laid out
    contiguously, in one TP group (no DP replicas): the kernel level covers those axes."""
    tp: int
    T: int
    H: int
    v_local: int
    dtype: str = choice("fp32", DTYPES)
    regime: str = choice("normal", LINEAR_CASE_REGIMES)
    chunk_size: int = -1
    with_entropy: bool = True
    with_entropy_grad: bool = True
    requires_grad: bool = True  # the hidden states and the weight shard require grad (or neither), but `frozen`
    loss_terms: str = choice("both", LOSS_TERMS)  # which outputs the upstream loss uses
    seed: int = 0
    frozen: str = choice("none", FROZEN)  # with requires_grad, the input that still requires no grad
    context: str = choice("train", LINEAR_CONTEXTS)
    hidden_view: str = choice("contiguous", HIDDEN_VIEWS)  # the memory of the hidden states handed over
    level: ClassVar[str] = "linear"
    dp: ClassVar[int] = 1
    layout: ClassVar[str] = "contiguous"

    grad_on = KernelCase.grad_on
    expects_entropy_grad = KernelCase.expects_entropy_grad
    has_backward = KernelCase.has_backward
    loss_takes_every_output = KernelCase.loss_takes_every_output

    @property
    def hidden_grad(self) -> bool:
        """The hidden states require grad (their gradient is asked for)."""
        return self.requires_grad and self.frozen != "hidden"

    @property
    def weight_grad(self) -> bool:
        """The weight shard requires grad (its gradient is asked for)."""
        return self.requires_grad and self.frozen != "weight"

    def group(self) -> str:
        return f"{self.level}-tp{self.tp}-{self.dtype}"

    def inputs(self) -> LinearInputs:
        """Drawn from (seed, T, H, V) only, not from the TP size, so the same global case at TP 1
        (tp-invariance) sees the same values."""
        g = _generator(self.seed)
        T, H, V = self.T, self.H, self.vocab
        scale = _LINEAR_SCALE[self.regime]
        hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
        # Rows of norm ~scale, so a logit h . w is ~N(0, scale^2) for unit-variance hidden states.
        weight = torch.randn(V, H, generator=g, dtype=torch.float64) * (scale / math.sqrt(max(H, 1)))
        tokens = torch.randint(0, V, (T,), generator=g)
        if self.regime == "peaked" and T and H:
            # One confident entry per row: the hidden state pushed along one weight row, raising that
            # logit by about _LINEAR_SPIKE (and the others by O(spike / sqrt(H)) at random).
            spike = torch.randint(0, V, (T,), generator=g)
            w = weight[spike]
            hidden += _LINEAR_SPIKE * w / w.pow(2).sum(-1, keepdim=True).clamp_min(1e-12)
        edges = sorted({i for k in (1, 2, 4, 8) if V % k == 0 for r in range(k)
                        for i in (r * (V // k), (r + 1) * (V // k) - 1)})  # as KernelCase.inputs
        n = min(T, len(edges))
        tokens[:n] = torch.tensor(edges[:n], dtype=torch.int64)
        if self.regime == DRIFT:
            hidden += torch.randn(H, generator=g, dtype=torch.float64)  # every row's channel means
        dtype = DTYPES[self.dtype]
        w1, w2 = torch.randn(T, generator=g), torch.randn(T, generator=g)
        if self.regime == DRIFT:
            w1, w2 = -w1.abs(), -w2.abs()
        lp, ent = self.loss_terms != "entropy", self.loss_terms != "log_prob"
        return LinearInputs(hidden.to(dtype), weight.to(dtype), tokens, w1 if lp else None, w2 if ent else None)


# The distillation level (docs/distill.md): which of its functions a case calls, the divergence, the
# teacher it is measured from (sharded logits over the whole vocabulary; sharded logits whose top-k the
# routine takes as the support; a teacher pass's top-k log-probs and global ids), the inputs' regime
# (`disjoint`: the teacher's top entries are the student's bottom ones) and how the routine is called.
DISTILL_FUNCTIONS = ("divergence", "log_softmax", "topk", "gather")
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "mixed", "soft_ce")
TEACHERS = ("full", "topk", "given")
DISTILL_REGIMES = ("normal", "peaked", "ties", "neginf", "disjoint", "fartail")
DISTILL_CONTEXTS = ("train", "no_grad")
_DISTILL_SCALE = 2.0  # logits N(0, 2^2): distributions neither uniform nor one-hot
_DISTILL_EDGE = 8.0  # a planted top entry on a shard edge stands this far above the rest


@dataclass(frozen=True)
class DistillInputs:
    student: torch.Tensor  # [T, V], case dtype
    teacher: torch.Tensor  # [T, V], case dtype (the teacher's logits; `given` hands over their top-k instead)
    topk_log_probs: torch.Tensor  # [T, k'] float32: the teacher pass's log-probs at its top-k (temperature 1)
    topk_ids: torch.Tensor  # [T, k'] int64 global ids: the `given` support, and `gather`'s indices
    weights: torch.Tensor  # float32 upstream weights of the output: [T], [T, V] (log_softmax) or [T, k'] (gather)


@dataclass(frozen=True)
class DistillCase(CaseBase):
    """A distillation case (docs/distill.md): one of the level's four functions on a student's (and a
    teacher's) `[T, V]` logits, sharded over the vocabulary. Inputs come from (seed, T, V) only, so
    the same global case at TP 1 (tp-invariance) sees the same values."""
    tp: int
    T: int
    v_local: int
    function: str = choice("divergence", DISTILL_FUNCTIONS)
    kind: str = choice("forward_kl", DIVERGENCES)
    teacher: str = choice("full", TEACHERS)
    k: int = 4  # top-k size: `topk`'s, the `topk`/`given` teacher's support, `gather`'s ids
    beta: float = 0.5  # jsd's mixture weight of the teacher, mixed's weight of the forward KL
    renormalize: bool = True  # a top-k support: both distributions renormalized over it
    temperature: float = 1.0
    dtype: str = choice("fp32", DTYPES)
    regime: str = choice("normal", DISTILL_REGIMES)
    chunk_size: int = -1
    requires_grad: bool = True  # the student's logits
    teacher_grad: bool = False  # the teacher's logits require grad too (full and topk teachers)
    self_teacher: bool = False  # the teacher's logits are the student's: every divergence but soft_ce is 0
    seed: int = 0
    dp: int = 1
    layout: str = choice("contiguous", LAYOUTS)  # of the student's logits handed over
    context: str = choice("train", DISTILL_CONTEXTS)
    level: ClassVar[str] = "distill"
    with_entropy: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = []
        if self.function == "topk" and (self.requires_grad or self.teacher_grad):
            problems.append("topk is the teacher's pass: requires_grad=0 and teacher_grad=0")
        if self.kind == "jsd" and not 0.0 < self.beta < 1.0:
            problems.append("jsd needs 0 < beta < 1")
        if not 0.0 <= self.beta <= 1.0:
            problems.append("beta is a weight in [0, 1]")
        if self.teacher_grad and (self.function != "divergence" or self.teacher == "given"):
            problems.append("teacher_grad needs a divergence from the teacher's logits (teacher full or topk)")
        if self.k < 1 and (self.function in ("topk", "gather") or self.teacher != "full"):
            problems.append("k >= 1")
        if self.teacher == "given" and not self.renormalize and self.temperature != 1.0:
            problems.append("given top-k log-probs are used as given without renormalize: temperature=1.0")
        if self.self_teacher and self.kind == "soft_ce":
            problems.append("self_teacher measures a divergence, and soft_ce(p, p) is the entropy")
        if self.temperature <= 0:
            problems.append("temperature > 0")
        if problems:
            raise ValueError(f"invalid distill case: {'; '.join(problems)}")

    @property
    def grad_on(self) -> bool:
        """The student's logits require grad and autograd is on."""
        return self.requires_grad and self.autograd

    @property
    def teacher_grad_on(self) -> bool:
        return self.teacher_grad and self.autograd

    @property
    def expects_entropy_grad(self) -> bool:
        return False

    @property
    def has_backward(self) -> bool:
        """The upstream loss reaches the student's (or a differentiable teacher's) logits."""
        return (self.grad_on or self.teacher_grad_on) and self.function != "topk"

    loss_takes_every_output = has_backward  # one output, always in the loss

    @property
    def width(self) -> int:
        """The top-k outputs' and gathered ids' columns: min(k, V)."""
        return min(self.k, self.vocab)

    @property
    def support_from_logits(self) -> bool:
        """A divergence over a top-k of the teacher's logits that the routine takes itself."""
        return self.function == "divergence" and self.teacher == "topk"

    def group(self) -> str:
        dp = f"-dp{self.dp}" if self.dp > 1 else ""
        what = self.function if self.function != "divergence" else f"{self.kind}-{self.teacher}"
        return f"{self.level}-tp{self.tp}{dp}-{what}"

    def inputs(self) -> DistillInputs:
        g = _generator(self.seed)
        T, V = self.T, self.vocab
        dtype = DTYPES[self.dtype]
        s = torch.randn(T, V, generator=g, dtype=torch.float64) * _DISTILL_SCALE
        t = torch.randn(T, V, generator=g, dtype=torch.float64) * _DISTILL_SCALE
        if self.regime == "peaked":
            rows = torch.arange(T)
            s[rows, torch.randint(0, max(V, 1), (T,), generator=g)] += 12.0
            t[rows, torch.randint(0, max(V, 1), (T,), generator=g)] += 12.0
        elif self.regime == "ties":  # ties within and across shards, and at the k-th place
            s = torch.randint(0, 3, (T, V), generator=g).to(torch.float64)
            t = torch.randint(0, 3, (T, V), generator=g).to(torch.float64)
        elif self.regime == "disjoint":  # the teacher's top-k is the student's bottom-k
            t = -s + 0.1 * t / _DISTILL_SCALE
        # The first and last id of every shard, for every TP layout of this vocab (as KernelCase's
        # tokens): a row's top entry sits on a shard edge, where an index off by a shard shows.
        edges = sorted({i for n in (1, 2, 4, 8) if V % n == 0 for r in range(n)
                        for i in (r * (V // n), (r + 1) * (V // n) - 1)})
        if self.regime != "ties":
            for row in range(min(T, len(edges))):
                s[row, edges[row]] = s[row].max() + _DISTILL_EDGE
                t[row, edges[-1 - row]] = t[row].max() + _DISTILL_EDGE
        if self.regime == "fartail" and T and V > 1:
            # The teacher's top entries (a quarter of the row, at least one) at the student's far tail,
            # 50 to 110 below the student's largest other entry: the student's log-probs at the
            # teacher's top-k and at the gathered ids reach -50 to -115, as `_far_tail`'s do.
            top = torch.sort(t, dim=-1, descending=True, stable=True).indices[:, :max(1, V // 4)]
            depth = 50.0 + 60.0 * torch.rand(top.shape, generator=g, dtype=torch.float64)
            near = s.scatter(-1, top, -math.inf).amax(-1, keepdim=True)
            s = s.scatter(-1, top, near - depth)
        if self.regime == "neginf" and T:
            # A masked vocabulary, the same entries -inf in both: the padded tail (as a vocabulary padded
            # to a multiple of the TP size ends in whole shards: its last quarter, a whole shard at TP 4,
            # and in every other row its last half, a whole shard at TP 2) and 30% of the rest; each row
            # keeps a finite entry before its tail, and its planted edges there.
            odd = torch.arange(T) % 2 == 1
            tail = torch.where(odd, V // 2, V // 4)
            masked = torch.rand(T, V, generator=g) < 0.3
            masked[torch.arange(T), torch.randint(0, V - V // 4, (T,), generator=g) % (V - tail)] = False
            for row in range(min(T, len(edges))):
                masked[row, [edges[row], edges[-1 - row]]] = False
            masked |= torch.arange(V) >= (V - tail).unsqueeze(-1)
            s, t = s.masked_fill(masked, -math.inf), t.masked_fill(masked, -math.inf)
        if self.support_from_logits and self.width < V and T:
            # The routine picks the support: no tie at the k-th place (docs/contract.md) in the values it
            # gets (rounded to the dtype, where distinct values can meet), ties inside the support kept.
            rounded = t.to(dtype).to(torch.float64)
            order = torch.sort(rounded, dim=-1, descending=True, stable=True).indices
            kth = rounded.gather(-1, order[:, self.width - 1:self.width + 1])
            tied = (kth[:, 0] == kth[:, 1]) & torch.isfinite(kth[:, 0])
            t[tied] = t[tied].scatter_add(-1, order[tied, :self.width], torch.ones(int(tied.sum()), self.width,
                                                                                  dtype=torch.float64))
        if self.self_teacher:
            s = t.clone()
        student, teacher = s.to(dtype), t.to(dtype)
        # The teacher pass's output at temperature 1: one top-k, its float32 log-probs.
        z = teacher.to(torch.float64)
        ids = torch.sort(z, dim=-1, descending=True, stable=True).indices[:, :self.width]
        lp = z.log_softmax(dim=-1).gather(-1, ids).to(torch.float32)
        if self.function == "log_softmax":
            w = torch.randn(T, V, generator=g).masked_fill(~torch.isfinite(student), 0.0)
        elif self.function in ("gather", "topk"):
            w = torch.randn(T, self.width, generator=g).masked_fill(~torch.isfinite(student.gather(-1, ids)), 0.0)
        else:
            w = torch.randn(T, generator=g)
        return DistillInputs(student, teacher, lp, ids, w)


# Case fields that are left out of a spec at their default value (see `spec`).
_LATER_FIELDS = frozenset({"dp", "layout", "token_layout", "context", "batch_of", "row_start", "repeat", "cp",
                           "cp_layout", "frozen", "hidden_view"})

Case = KernelCase | WrapperCase | LinearCase | DistillCase


def fmt_field(value: Any) -> str:
    """A field's value as case specs write it (None is `absent`, a bool 0/1, a tuple `a/b`)."""
    if value is None:
        return "absent"
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, tuple):
        return "/".join(str(v) for v in value) or "-"
    return repr(value) if isinstance(value, float) else str(value)


def _parse(raw: str, annotation: str) -> Any:
    if "tuple" in annotation:
        return tuple(int(v) for v in raw.split("/")) if raw != "-" else ()
    if raw == "absent" and "None" in annotation:
        return None
    if annotation.startswith("bool"):
        if raw not in ("0", "1"):
            raise ValueError(f"{raw!r} is not a flag (0 or 1)")
        return raw == "1"
    if annotation.startswith("int"):
        return int(raw)
    if annotation.startswith("float"):
        return float(raw)
    return raw


def field_syntax(f: dataclasses.Field) -> str:
    """What a spec may write for a field: its values, or the form of its type."""
    if "values" in f.metadata:
        return "|".join(f.metadata["values"])
    annotation = str(f.type)
    forms = [("tuple", "N/N/... (- for none)"), ("bool", "0|1"), ("int", "integer"), ("float", "number")]
    form = next((text for key, text in forms if annotation.startswith(key)), annotation)
    return form + ("|absent" if "None" in annotation else "")


def parse_case(spec: str) -> Case:
    """Inverse of `spec()`; raises ValueError naming the offending part and what is valid there."""
    level, _, body = spec.partition(":")
    if level not in CASE_TYPES:
        raise ValueError(f"unknown case level {level!r} in {spec!r}; valid: {', '.join(CASE_TYPES)}")
    cls = CASE_TYPES[level]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for part in filter(None, body.split(",")):
        key, sep, raw = part.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"unknown case field {part!r}: {level} cases have "
                             + ", ".join(f"{k}={field_syntax(f)}" for k, f in fields.items()))
        try:
            values[key] = _parse(raw, str(fields[key].type))
        except ValueError:
            raise ValueError(f"bad value in {part!r}: {key} takes {field_syntax(fields[key])}") from None
    missing = [k for k, f in fields.items() if k not in values
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{spec!r} lacks {', '.join(missing)}: every {level} case sets them")
    return cls(**values)
