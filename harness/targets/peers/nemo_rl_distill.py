"""NeMo-RL's top-k distillation (`nemo_rl/distributed/model_utils.py`, `DistillationLossFn`), as its Megatron trainer composes it.

The teacher's pass top-ks the teacher's vocab-sharded logits with `distributed_vocab_topk`
(`nemo_rl/models/megatron/train.py:726`) and stores their values and global ids; the student's
loss calls `get_distillation_topk_logprobs_from_logits` on its own sharded logits and those
(`nemo_rl/algorithms/loss/utils.py:123-135`), then `DistillationLossFn` turns the log-probs on the
support into a per-token KL (`nemo_rl/algorithms/loss/loss_functions.py:1150-1181`) and a masked
mean. The contract's functions map onto that:

- `distill_divergence`: a `given` teacher only (NeMo-RL's teacher is a pass's top-k), `kind`
  `forward_kl`, `reverse_kl` or `mixed` (`kl_type`, `beta` as `mixed_kl_weight`), `renormalize` as
  `not zero_outside_topk`, the entropy asked for exactly where NeMo-RL asks (`loss/utils.py:123`),
  no temperature. The teacher's values are log-probs here and logits in NeMo-RL: both sides are
  renormalized over the support (`get_distillation_topk_logprobs_from_logits`' log_softmax), which a
  per-row shift does not change.
- `distill_gather`: the student's output of the same function (`zero_outside_topk` as
  `not renormalize`), with placeholder teacher values.
- `distill_topk`: `distributed_vocab_topk` on `vocab_parallel_log_softmax`'s shard, so its values
  are log-probs (NeMo-RL's trainer top-ks the raw logits: the same ids, the log-softmax being
  increasing in each row, and values its loss renormalizes anyway).
- `distill_log_softmax`: `vocab_parallel_log_softmax` (used by NeMo-RL's cross-tokenizer loss,
  `loss_functions.py:2302`).

`get_distillation_topk_logprobs_from_logits` aligns next-token positions by dropping each row's last
position (`[:, :-1]`): the adapter appends one placeholder row to the student's logits and to the
teacher's top-k and hands back the first T rows. The per-token KL is `DistillationLossFn`'s, read
before its reduction: `masked_mean` is NeMo-RL's reduction of it (a weighted sum the harness's loss
makes itself), so `loss_functions.py` is loaded on its own (`_source`) with `nemo_rl.algorithms.utils`
stubbed: `masked_mean` hands its values back as they are, `calculate_kl` (not called by this loss)
raises. Past forms: a commit without `vocab_parallel_log_softmax` or
`get_distillation_topk_logprobs_from_logits` defines no function over it. `nemo_rl.algorithms.utils` and `nemo_rl/algorithms/loss/__init__.py` import NeMo-RL's
generation stack (vLLM, zmq), which this loss never calls; `interfaces.py` is loaded on its own too,
and both see `BatchedDataDict` as `dict` (they only name it in annotations; its module imports the
multimodal data stack at some commits). Before `nemo_rl/algorithms/loss/` existed the adapter is
`untestable` (RoutineMissing).

Its trainer's use: NeMo-RL's callers give this routine the model's raw bf16 or float32 logits, never
`-inf` (`megatron/train.py:726`, `loss/utils.py:125`: the teacher's and the student's model outputs),
at TP sizes whose shards hold tens of thousands of ids, with k the config's `topk_logits_k` (64,
`examples/configs/distillation_math.yaml:13`), so never beyond a shard; and `zero_outside_topk`
false in every shipped config (`distillation_math.yaml:19`). `HARNESS_USE` lists the cases beyond.
"""
from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers import defines
from harness.targets.peers._source import PeerSource, missing

HOW = ("git clone https://github.com/NVIDIA-NeMo/RL nemo-rl && export PYTHONPATH=$PWD/nemo-rl:$PYTHONPATH "
       "(torch alone runs its model_utils and its distillation loss on CPU)")
HARNESS = Declaration(
    capabilities={"full_teacher": False, "topk_teacher": False, "jsd": False, "soft_ce": False,
                  "temperature": False, "teacher_grad": False},
    peer=PeerInfo(
        requires=("nemo_rl.distributed.model_utils",), install=HOW,
        upstream=("nemo_rl.distributed.model_utils.get_distillation_topk_logprobs_from_logits",
                  "nemo_rl.distributed.model_utils.distributed_vocab_topk",
                  "nemo_rl.distributed.model_utils.vocab_parallel_log_softmax",
                  "nemo_rl.algorithms.loss.loss_functions.DistillationLossFn")),
    # Cases NeMo-RL's own callers never make (the `where` of known files, docs/known-findings.md).
    use=[
        {"where": {"regime": "neginf"},
         "why": "the student's and the teacher's logits are the models' raw outputs, never -inf: "
                "nemo_rl/models/megatron/train.py:726 (teacher), nemo_rl/algorithms/loss/utils.py:125 (student)"},
        {"where": {"function": "topk", "T": 0},
         "why": "the teacher's pass top-ks a microbatch's sequences, never an empty one: "
                "nemo_rl/models/megatron/train.py:726"},
        {"where": {"function": "divergence", "renormalize": False, "kind": ["reverse_kl", "mixed"]},
         "why": "zero_outside_topk is false in the shipped distillation configs: "
                "examples/configs/distillation_math.yaml:19"},
    ],
)

_LOSS_FILE = "nemo_rl/algorithms/loss/loss_functions.py"
_MARKERS = ("nemo_rl/distributed",)


def _raises(name: str):
    def stub(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"nemo_rl.algorithms.utils.{name} is stubbed by the adapter: this loss never calls it")
    return stub


def _values(values: torch.Tensor, mask: Any = None, dim: Any = None, global_normalization_factor: Any = None):
    """Stands for nemo_rl.algorithms.utils.masked_mean: the per-token values before NeMo-RL's reduction."""
    return values


# BatchedDataDict is only named in these files' annotations (`BatchedDataDict[...]`); the loss reads its
# data as a mapping. Its module imports NeMo-RL's multimodal data stack (decord) at some commits.
_DATA = {"nemo_rl.distributed.batched_data_dict": {"BatchedDataDict": dict}}
INTERFACES = PeerSource("NeMo-RL-loss-interfaces", files=("nemo_rl/algorithms/loss/interfaces.py",), markers=_MARKERS,
                        how=HOW, stubs=_DATA)
_IF = INTERFACES.load()
LOSSES = PeerSource("NeMo-RL-loss-functions", files=(_LOSS_FILE,), markers=_MARKERS, how=HOW, stubs={
    **_DATA,
    "nemo_rl.algorithms.loss.interfaces": dict(vars(_IF)) if _IF is not None else {},
    "nemo_rl.algorithms.utils": {"masked_mean": _values, "calculate_kl": _raises("calculate_kl")},
})
_LF = LOSSES.load() if _IF is not None else None
if _LF is not None:
    missing(LOSSES, _LF, "DistillationLossFn", "DistillationLossConfig")


def _mu() -> types.ModuleType:
    import nemo_rl.distributed.model_utils as mu  # pyright: ignore[reportMissingImports]

    return mu


def _group(tp_group: Any) -> tuple[Any, int, int]:
    if tp_group is None:
        if not dist.is_initialized():
            raise RuntimeError("NeMo-RL's distillation functions reduce over a process group: initialise torch.distributed")
        tp_group = dist.group.WORLD
    return tp_group, dist.get_rank(tp_group), dist.get_world_size(tp_group)


def _no_temperature(temperature: float) -> None:
    if temperature != 1.0:
        raise NotImplementedError("NeMo-RL's distillation loss takes no temperature (HARNESS_CAPABILITIES)")


def _with_placeholder_row(student: torch.Tensor, values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[1, T + 1, ...] inputs: the function drops each sequence's last position."""
    k = ids.shape[-1]
    spare_ids = torch.arange(k, device=ids.device).unsqueeze(0)  # distinct ids of the vocabulary (K <= V)
    student = torch.cat([student, student.new_zeros((1, student.shape[-1]))]).unsqueeze(0)
    values = torch.cat([values.to(torch.float32), values.new_zeros((1, k), dtype=torch.float32)]).unsqueeze(0)
    return student, values, torch.cat([ids.to(torch.int64), spare_ids]).unsqueeze(0)


def _support_log_probs(student, values, ids, group, rank, zero_outside_topk, calculate_entropy):
    s, v, i = _with_placeholder_row(student, values, ids)
    return _mu().get_distillation_topk_logprobs_from_logits(
        student_logits=s, teacher_topk_logits=v, teacher_topk_indices=i, zero_outside_topk=zero_outside_topk,
        calculate_entropy=calculate_entropy, vocab_parallel_rank=rank, vocab_parallel_group=group)


def distill_log_softmax(logits, tp_group, temperature=1.0, chunk_size=-1):
    """`vocab_parallel_log_softmax`: this rank's shard of log_softmax(logits / temperature)."""
    group, _, _ = _group(tp_group)
    return _mu().vocab_parallel_log_softmax(logits, temperature, tp_group=group)


def distill_topk(logits, k, tp_group, temperature=1.0, chunk_size=-1):
    """`distributed_vocab_topk` on the log-softmax shard: `(log_probs [T, k'], ids [T, k'])`."""
    group, rank, _ = _group(tp_group)
    v_local = logits.shape[-1]
    log_probs = _mu().vocab_parallel_log_softmax(logits, temperature, tp_group=group)
    values, ids = _mu().distributed_vocab_topk(log_probs.unsqueeze(0), k, group, vocab_start_index=rank * v_local,
                                               vocab_end_index=(rank + 1) * v_local,
                                               chunk_size=chunk_size if chunk_size > 0 else None)
    return values[0], ids[0]


def distill_gather(logits, indices, tp_group, temperature=1.0, chunk_size=-1, renormalize=False):
    """The student's log-probs at the ids from `get_distillation_topk_logprobs_from_logits`."""
    _no_temperature(temperature)
    group, rank, _ = _group(tp_group)
    placeholder = torch.zeros(indices.shape, dtype=torch.float32, device=logits.device)
    student, _, _ = _support_log_probs(logits, placeholder, indices, group, rank, not renormalize, False)
    return student[0]


def distill_divergence(student_logits, tp_group, *, teacher_logits=None, teacher_topk_log_probs=None,
                       teacher_topk_indices=None, k=0, kind="forward_kl", beta=0.5, temperature=1.0,
                       renormalize=True, chunk_size=-1):
    """`DistillationLossFn`'s per-token KL over a teacher pass's top-k."""
    if teacher_topk_log_probs is None or teacher_topk_indices is None:
        raise NotImplementedError("NeMo-RL distills from a teacher pass's top-k only (HARNESS_CAPABILITIES)")
    _no_temperature(temperature)
    kl_type = {"forward_kl": "forward", "reverse_kl": "reverse", "mixed": "mixed"}[kind]
    group, rank, _ = _group(tp_group)
    lf = LOSSES.require(_LF)
    loss_fn = lf.DistillationLossFn(lf.DistillationLossConfig(kl_type=kl_type, mixed_kl_weight=beta,
                                                              zero_outside_topk=not renormalize))
    # NeMo-RL's rule for the entropy (nemo_rl/algorithms/loss/utils.py:123).
    calculate_entropy = loss_fn.zero_outside_topk and loss_fn.kl_type != "forward"
    s, t, h = _support_log_probs(student_logits, teacher_topk_log_probs, teacher_topk_indices, group, rank,
                                 loss_fn.zero_outside_topk, calculate_entropy)
    rows = student_logits.shape[0] + 1
    ones = torch.ones(1, rows, device=student_logits.device)
    data = {"input_ids": torch.zeros(1, rows, dtype=torch.int64), "token_mask": ones, "sample_mask": ones[:, 0]}
    per_token, _ = loss_fn(s, t, h, data, global_valid_seqs=torch.ones(()), global_valid_toks=torch.ones(()))
    return per_token[0]


# Past forms: a commit before one of the routines defines no function over it (read from the tree's
# source, without importing NeMo-RL), so the harness checks the others and says which it left out.
_MODEL_UTILS = "nemo_rl.distributed.model_utils"
if defines(_MODEL_UTILS, "vocab_parallel_log_softmax") is False:
    del distill_log_softmax, distill_topk  # the top-k is taken on its log-softmax
if defines(_MODEL_UTILS, "get_distillation_topk_logprobs_from_logits") is False:
    del distill_gather, distill_divergence
