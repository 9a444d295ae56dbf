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
- `distill_topk`: `distributed_vocab_topk` on the logits as they come, in their dtype (bf16 in a bf16
  run), with the case's `chunk_size` as its `chunk_size`, as the teacher's pass calls it
  (`nemo_rl/models/megatron/train.py:722-733`: the model's `output_tensor`, `chunk_size` the
  policy's `logprob_chunk_size`); its values are the top-k logits, which the adapter makes log-probs
  by subtracting each row's log-normaliser, computed row chunk by row chunk in float32 (the
  contract's `distill_topk` returns log-probs; NeMo-RL's loss renormalizes the values anyway). So the
  distillation level's memory checks see NeMo-RL's own upcast of bf16 logits (whole before #2883,
  `178110fa7`; one chunk at a time since).
- `distill_log_softmax`: `vocab_parallel_log_softmax` (used by NeMo-RL's cross-tokenizer loss,
  `loss_functions.py:2302`).

`get_distillation_topk_logprobs_from_logits` aligns next-token positions by dropping each row's last
position (`[:, :-1]`): the adapter appends one placeholder row to the student's logits and to the
teacher's top-k and hands back the first T rows. The student's logits reach it in the case's dtype:
its caller passes the model's logits (`nemo_rl/algorithms/loss/utils.py:123-135`, unchunked), and it
upcasts them itself (`student_logits.to(torch.float32)`).

Each routine is found by what it is (`_source.PeerSource.find`), compiled alone with the names it
reads, the peer's own modules read file by file (NeMo-RL's package `__init__`s and
`nemo_rl.algorithms.utils` import its generation stack, vLLM and zmq, which these never call):
`distributed_vocab_topk`, `get_distillation_topk_logprobs_from_logits` and `vocab_parallel_log_softmax`
in `nemo_rl/distributed/model_utils.py`; `DistillationLossFn` in `nemo_rl/algorithms/loss/loss_functions.py`
(since #1920, `dc9dce44b`: it takes the support's log-probs) or, before,
`nemo_rl/algorithms/loss_functions.py` (#1006, `17ea9abfb`: it takes the student's logits and gathers
them itself). The per-token KL is `DistillationLossFn`'s, read before its reduction: `masked_mean` is
NeMo-RL's reduction of it (a weighted sum the harness's loss makes itself), so the adapter provides
it as a function that hands its values back (`provides`). A function whose routine a commit lacks is
not defined; a commit with none of them (before #1006) is `untestable`, saying so.

Its trainer's use: NeMo-RL's callers give this routine the model's raw bf16 or float32 logits, never
`-inf` (`megatron/train.py:726`, `loss/utils.py:125`: the teacher's and the student's model outputs),
at TP sizes whose shards hold tens of thousands of ids, with k the config's `topk_logits_k` (64,
`examples/configs/distillation_math.yaml:13`), so never beyond a shard; and `zero_outside_topk`
false in every shipped config (`distillation_math.yaml:19`). `HARNESS_USE` lists the cases beyond.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import torch.distributed as dist

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._source import PeerSource, RoutineMissing

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


def _values(values: torch.Tensor, mask: Any = None, dim: Any = None, global_normalization_factor: Any = None):
    """Stands for nemo_rl.algorithms.utils.masked_mean: the per-token values before NeMo-RL's reduction."""
    return values


SOURCE = PeerSource("NeMo-RL-distillation", markers=("nemo_rl/distributed",), how=HOW, provides={"masked_mean": _values},
                    files=("nemo_rl/distributed/model_utils.py", "nemo_rl/algorithms/loss/loss_functions.py",
                           "nemo_rl/algorithms/loss_functions.py"))


def _found(name: str) -> Any:
    """`name` from the commit's tree, or None where it does not define it (or there is no tree)."""
    return SOURCE.find(name) if SOURCE.defines(name) else None


_TOPK, _GATHER = _found("distributed_vocab_topk"), _found("get_distillation_topk_logprobs_from_logits")
_LOG_SOFTMAX, _LOSS = _found("vocab_parallel_log_softmax"), _found("DistillationLossFn")
_CONFIG = _found("DistillationLossConfig")
if SOURCE.defines("distributed_vocab_topk") is False and _LOSS is None:
    raise RoutineMissing(f"NeMo-RL's tree `{SOURCE.roots()[0].name}` defines none of its distillation routines "
                         "(distributed_vocab_topk, DistillationLossFn): a commit before its distillation (#1006)")
# The loss's form: since #1920 it takes the support's log-probs; before, the student's logits.
_FROM_LOGITS = _LOSS is not None and "next_token_logits" in inspect.signature(_LOSS.__call__).parameters


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
    return SOURCE.require(_GATHER)(
        student_logits=s, teacher_topk_logits=v, teacher_topk_indices=i, zero_outside_topk=zero_outside_topk,
        calculate_entropy=calculate_entropy, vocab_parallel_rank=rank, vocab_parallel_group=group)


def distill_log_softmax(logits, tp_group, temperature=1.0, chunk_size=-1):
    """`vocab_parallel_log_softmax`: this rank's shard of log_softmax(logits / temperature)."""
    group, _, _ = _group(tp_group)
    return SOURCE.require(_LOG_SOFTMAX)(logits, temperature, tp_group=group)


def distill_topk(logits, k, tp_group, temperature=1.0, chunk_size=-1):
    """`distributed_vocab_topk` on the logits in their dtype, chunked as the teacher's pass chunks it:
    `(log_probs [T, k'], ids [T, k'])`, the values made log-probs by each row's log-normaliser."""
    _no_temperature(temperature)
    group, rank, _ = _group(tp_group)
    v_local = logits.shape[-1]
    chunk = chunk_size if chunk_size > 0 else None
    values, ids = SOURCE.require(_TOPK)(logits.unsqueeze(0), k, group, vocab_start_index=rank * v_local,
                                        vocab_end_index=(rank + 1) * v_local, chunk_size=chunk)
    return values[0].float() - _log_normaliser(logits, group, chunk or max(1, logits.shape[0])), ids[0]


def _log_normaliser(logits: torch.Tensor, group: Any, chunk: int) -> torch.Tensor:
    """Each row's log-sum-exp over the whole vocabulary, `[T, 1]`, one row chunk upcast at a time."""
    out = []
    for s0 in range(0, logits.shape[0], chunk):
        x = logits[s0:s0 + chunk].detach().float()
        top = x.max(dim=-1, keepdim=True).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        total = (x - top).exp().sum(dim=-1, keepdim=True)
        dist.all_reduce(total, group=group)
        out.append(top + total.log())
    return torch.cat(out) if out else logits.new_zeros((0, 1), dtype=torch.float32)


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
    config = SOURCE.require(_CONFIG)(kl_type=kl_type, mixed_kl_weight=beta, zero_outside_topk=not renormalize)
    loss_fn = SOURCE.require(_LOSS)(config)
    rows = student_logits.shape[0] + 1
    ones = torch.ones(1, rows, device=student_logits.device)
    data = {"input_ids": torch.zeros(1, rows, dtype=torch.int64), "token_mask": ones, "sample_mask": ones[:, 0]}
    if _FROM_LOGITS:  # #1006's form: the loss gathers the student's logits itself
        s, t, i = _with_placeholder_row(student_logits, teacher_topk_log_probs, teacher_topk_indices)
        per_token, _ = loss_fn(s, {**data, "teacher_topk_logits": t, "teacher_topk_indices": i},
                               global_valid_seqs=torch.ones(()), global_valid_toks=torch.ones(()),
                               vocab_parallel_rank=rank, vocab_parallel_group=group)
        return per_token[0]
    # NeMo-RL's rule for the entropy (nemo_rl/algorithms/loss/utils.py:123).
    calculate_entropy = loss_fn.zero_outside_topk and loss_fn.kl_type != "forward"
    s, t, h = _support_log_probs(student_logits, teacher_topk_log_probs, teacher_topk_indices, group, rank,
                                 loss_fn.zero_outside_topk, calculate_entropy)
    per_token, _ = loss_fn(s, t, h, data, global_valid_seqs=torch.ones(()), global_valid_toks=torch.ones(()))
    return per_token[0]


def nemo_rl_log_softmax(mu, logits, tp_group, temperature=1.0):
    """NeMo-RL's call of `mu`, its `nemo_rl/distributed/model_utils.py`, as its cross-tokenizer loss makes
    it: `vocab_parallel_log_softmax(logits, temperature, tp_group=...)`, this rank's shard. Needs only
    torch and `mu`: `harness repro --script` embeds it. Only the log-softmax: the distillation level's
    scripts take a full teacher, and NeMo-RL's divergence takes a teacher pass's top-k only."""
    return mu.vocab_parallel_log_softmax(logits, temperature, tp_group=tp_group)


# `harness repro --script` (from #2745 on, where the tree has `vocab_parallel_log_softmax`): NeMo-RL's module,
# imported from the tree on PYTHONPATH, and the call.
if SOURCE.defines("vocab_parallel_log_softmax") is not False:
    HARNESS = dataclasses.replace(HARNESS, script={
        "name": "NeMo-RL", "files": {"mu": "nemo_rl.distributed.model_utils"}, "distill": nemo_rl_log_softmax,
        "how": "git clone https://github.com/NVIDIA-NeMo/RL nemo-rl && export PYTHONPATH=$PWD/nemo-rl:$PYTHONPATH"})

# A function whose routine this commit lacks is not defined: the harness checks the others and says which
# it left out (the top-k before #1006; the log-softmax before #2745; the gather before #1920).
if SOURCE.defines("distributed_vocab_topk") is False:
    del distill_topk
if SOURCE.defines("vocab_parallel_log_softmax") is False:
    del distill_log_softmax
if SOURCE.defines("get_distillation_topk_logprobs_from_logits") is False:
    del distill_gather
if SOURCE.defines("DistillationLossFn") is False:
    del distill_divergence
