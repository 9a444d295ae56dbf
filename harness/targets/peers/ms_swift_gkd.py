"""ms-swift's Megatron GKD loss (`swift/rlhf_trainers/gkd_loss.py::gkd_loss` with `swift/megatron/trainers/vocab_parallel_utils.py` and `gkd_utils.py`), as its Megatron trainer composes it.

`MegatronGKDTrainer.loss_func` (`swift/megatron/trainers/gkd_trainer.py:344-362`) calls
`gkd_loss(student_logits, teacher_output, labels, beta, temperature, gather_fn=tp_gather_topk,
log_softmax_fn=vocab_parallel_log_softmax, kl_div_fn=vocab_parallel_kl_div)`: the positions whose
label is not -100, both sides' logits divided by the temperature, then the generalized JSD with
`beta` (0: forward KL, 1: reverse KL, `gkd_loss.py:138-144`). With a full teacher (`full_logits`)
the softmaxes and the KL run over the sharded vocabulary through `vocab_parallel_log_softmax` and
`vocab_parallel_kl_div`; with a top-k teacher (`topk_logprobs`, `topk_indices`: a local teacher's
`vocab_parallel_topk` of its logits, `gkd_trainer.py:262-264`, or a teacher server's top-k
log-probs) the student's logits are gathered at the global ids (`tp_gather_topk`) and both sides are
renormalized over the support (`gkd_loss.py:257-260`). The contract's functions map onto that:

- `distill_divergence`: `full`, `topk` (the local teacher's `vocab_parallel_topk`) and `given`
  teachers; `kind` `forward_kl`, `reverse_kl` or `jsd` (as `beta` 0, 1 or the case's beta); a top-k
  support always renormalized. `gkd_loss` returns the sum over the labelled positions: the adapter
  labels one position per call, as the trainer's labels select positions, and stacks the T sums.
- `distill_log_softmax`: `vocab_parallel_log_softmax` of the logits divided by the temperature.
- `distill_gather`: `tp_gather_topk` of the divided logits, log-softmaxed over the support, as
  `gkd_loss`'s top-k path does (renormalized only).
- `distill_topk`: `vocab_parallel_topk` of `vocab_parallel_log_softmax`'s shard, so its values are
  log-probs (the trainer top-ks the teacher's raw logits: the same ids; its loss renormalizes).

Each routine is found by what it is (`_source.PeerSource.find`), in the layout the commit has:

- since `f12344c17` (#9471): the functions above, in `swift/rlhf_trainers/gkd_loss.py`,
  `swift/megatron/trainers/gkd_utils.py` and `vocab_parallel_utils.py`;
- before it, the trainer-method layout: the loss is `MegatronGKDTrainer.generalized_jsd_loss` in
  `swift/megatron/trainers/gkd_trainer.py`, with its top-k JSD `_jsd_topk` (from `0d7c9f5bc`, #7918)
  and, from `e98904c25` (#8319), the methods `_vocab_parallel_topk` and `_tp_gather_topk`; the
  log-softmax and KL are the functions of `vocab_parallel_utils.py` (from `90afa99a3`, #7263) or,
  before, the trainer's `_vocab_parallel_log_softmax` and `_vocab_parallel_kl_div`. The method is
  compiled in a class holding only it and the methods it reaches through `self`, on an instance
  with the attributes the trainer's `__init__` sets and the loss reads (`temperature`; `args` at
  CP 1). The earliest form reads `get_args()` (Megatron-LM's `megatron.training`, not needed by the
  loss otherwise): the adapter provides it as the trainer's arguments at CP 1
  (`context_parallel_size`, the one field the loss reads). Where a commit has no top-k routine
  (before #7918; the inline `torch.topk` of the local teacher before #8319) the capability it would
  need is declared absent for that commit, and a function it lacks is not defined.

Nothing else is stubbed. The TP group is `parallel_state`'s (the adapter checks it is the harness's).

Its trainer's use: the teacher's logits come detached (`gkd_trainer.py:259-260`: a forward under
`torch.no_grad()`), so a differentiable teacher is beyond it; `gkd_logits_topk` is a positive k
(`swift/megatron/arguments/megatron_args.py:243-245`) that a shard of a real vocabulary holds many
times over. `HARNESS_USE` lists the cases beyond its use.
"""
from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace
from typing import Any

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._mpu import parallel_state_group
from harness.targets.peers._source import PeerSource

HOW = ("git clone https://github.com/modelscope/ms-swift && export PYTHONPATH=$PWD/ms-swift:$PYTHONPATH "
       "(its GKD loss needs torch and megatron-core only)")
_TRAINER = "MegatronGKDTrainer"
_CP1 = SimpleNamespace(context_parallel_size=1)  # the trainer's arguments, as far as the loss reads them
SOURCE = PeerSource("ms-swift-gkd", markers=("swift/megatron",), how=HOW, provides={"get_args": lambda: _CP1},
                    files=("swift/rlhf_trainers/gkd_loss.py", "swift/megatron/trainers/gkd_utils.py",
                           "swift/megatron/trainers/vocab_parallel_utils.py", "swift/megatron/trainers/gkd_trainer.py"))


def _first(*names: str) -> Any:
    """The first of `names` (a function, or a trainer's `Class.method`) the commit defines, as a callable
    (a method bound to an instance of the adapter's); None when it defines none (or has no tree)."""
    for name in names:
        if SOURCE.defines(name):
            cls, _, method = name.rpartition(".")
            return getattr(_trainer(SOURCE.find(name)), method) if cls else SOURCE.find(name)
    return None


def _trainer(cls: Any) -> Any:
    """An instance of the lean trainer class, with what the trainer's `__init__` sets and the loss reads."""
    if cls is None:
        return None
    trainer = cls.__new__(cls)
    trainer.args, trainer.temperature = _CP1, 1.0
    return trainer


_SPLIT = SOURCE.defines("gkd_loss")  # None without ms-swift's tree on sys.path
_GKD = SOURCE.find("gkd_loss") if _SPLIT else None
_OUTPUT = SOURCE.find("TeacherOutput") if _SPLIT else None
_OLD = _trainer(SOURCE.find(f"{_TRAINER}.generalized_jsd_loss")) if _SPLIT is False else None
_LOG_SOFTMAX = _first("vocab_parallel_log_softmax", f"{_TRAINER}._vocab_parallel_log_softmax")
_KL_DIV = _first("vocab_parallel_kl_div", f"{_TRAINER}._vocab_parallel_kl_div")
_TOPK = _first("vocab_parallel_topk", f"{_TRAINER}._vocab_parallel_topk")
_GATHER = _first("tp_gather_topk", f"{_TRAINER}._tp_gather_topk")
# The top-k JSD (a teacher pass's top-k) exists from #7918 on: generalized_jsd_loss takes it then.
_GIVEN = _OLD is None or "teacher_topk_logprobs" in inspect.signature(_OLD.generalized_jsd_loss).parameters

HARNESS = Declaration(
    capabilities={"mixed": False, "soft_ce": False, "unnormalized": False,
                  **({} if _TOPK is not None or _SPLIT is None else {"topk_teacher": False}),
                  **({} if _GIVEN else {"given_teacher": False})},
    peer=PeerInfo(requires=("megatron.core", "swift"), install=HOW, upstream=(
        "swift.rlhf_trainers.gkd_loss.gkd_loss",
        "swift.megatron.trainers.vocab_parallel_utils.vocab_parallel_log_softmax",
        "swift.megatron.trainers.vocab_parallel_utils.vocab_parallel_kl_div",
        "swift.megatron.trainers.gkd_utils.vocab_parallel_topk",
        "swift.megatron.trainers.gkd_utils.tp_gather_topk")),
    use=[
        {"where": {"teacher_grad": True},
         "why": "the teacher's logits are a no_grad forward's, detached: swift/megatron/trainers/gkd_trainer.py:259-260"},
        {"where": {"regime": "neginf", "teacher": ["full", "topk"]},
         "why": "the student's and a local teacher's logits are the models' raw outputs, never -inf: "
                "swift/megatron/trainers/gkd_trainer.py:258 (teacher), 420 (student)"},
    ],
)

_BETA = {"forward_kl": 0.0, "reverse_kl": 1.0}


def _group(tp_group) -> None:
    parallel_state_group(tp_group, "ms-swift's GKD utilities")


def distill_log_softmax(logits, tp_group, temperature=1.0, chunk_size=-1):
    """`vocab_parallel_log_softmax(logits / temperature)`: this rank's shard, in the logits' dtype."""
    _group(tp_group)
    return SOURCE.require(_LOG_SOFTMAX)(logits / temperature)


def distill_topk(logits, k, tp_group, temperature=1.0, chunk_size=-1):
    """`vocab_parallel_topk` of the log-softmax shard: `(log_probs [T, k], ids [T, k])`."""
    _group(tp_group)
    log_probs = SOURCE.require(_LOG_SOFTMAX)(logits / temperature)
    values, ids = SOURCE.require(_TOPK)(log_probs, k=k)
    return values, ids


def distill_gather(logits, indices, tp_group, temperature=1.0, chunk_size=-1, renormalize=False):
    """`tp_gather_topk` of the divided logits, log-softmaxed over the support (gkd_loss's top-k path)."""
    if not renormalize:
        raise NotImplementedError("ms-swift renormalizes over a top-k support (HARNESS_CAPABILITIES)")
    _group(tp_group)
    gathered = SOURCE.require(_GATHER)(logits, indices.to(torch.int64))
    return torch.nn.functional.log_softmax(gathered / temperature, dim=-1)


def distill_divergence(student_logits, tp_group, *, teacher_logits=None, teacher_topk_log_probs=None,
                       teacher_topk_indices=None, k=0, kind="forward_kl", beta=0.5, temperature=1.0,
                       renormalize=True, chunk_size=-1):
    """`gkd_loss` per position: the generalized JSD (or a KL) of one labelled position per call."""
    if not renormalize:
        raise NotImplementedError("ms-swift renormalizes over a top-k support (HARNESS_CAPABILITIES)")
    _group(tp_group)
    beta = _BETA.get(kind, beta)
    if teacher_logits is not None and k <= 0:
        teacher = dict(full_logits=teacher_logits.unsqueeze(0))
    elif teacher_logits is not None:  # a local teacher's top-k (gkd_trainer.py:262-264; _vocab_parallel_topk before)
        values, ids = SOURCE.require(_TOPK)(teacher_logits.unsqueeze(0), k=k)
        teacher = dict(topk_logprobs=values, topk_indices=ids)
    else:
        assert teacher_topk_log_probs is not None and teacher_topk_indices is not None  # a teacher pass's top-k
        teacher = dict(topk_logprobs=teacher_topk_log_probs.unsqueeze(0), topk_indices=teacher_topk_indices.unsqueeze(0))
    rows = student_logits.shape[0]
    student = student_logits.unsqueeze(0)
    per_token = []
    for t in range(rows):
        labels = torch.full((1, rows), -100, dtype=torch.int64, device=student.device)
        labels[0, t] = 0  # the one position this call's loss takes
        total = _loss(student, teacher, labels, beta, temperature, chunk_size)
        per_token.append(total)
    if not per_token:  # no position: an empty result that follows the logits' autograd state
        return student_logits.float().sum(-1)
    return torch.stack(per_token)


def _loss(student: torch.Tensor, teacher: dict, labels: torch.Tensor, beta: float, temperature: float,
          chunk_size: int) -> torch.Tensor:
    """The layout's loss over the labelled positions: `gkd_loss`, or the trainer's `generalized_jsd_loss`."""
    chunk = {"chunk_size": chunk_size} if chunk_size > 0 else {}
    if _OLD is not None:
        trainer = _trainer(_OLD.__class__)
        trainer.temperature = temperature
        topk = {} if "topk_indices" not in teacher else {  # the top-k JSD's arguments, from #7918 on
            "teacher_topk_logprobs": teacher["topk_logprobs"], "teacher_topk_indices": teacher["topk_indices"]}
        return trainer.generalized_jsd_loss(student, teacher.get("full_logits"), labels, beta, **chunk, **topk)
    output = SOURCE.require(_OUTPUT)
    # `labels` is a field from #9580 (`b185df1ee`) on; before it the trainer's GKD set no teacher labels.
    own = {"labels": labels} if "labels" in {f.name for f in dataclasses.fields(output)} else {}
    total, _ = SOURCE.require(_GKD)(student, output(**teacher, **own), labels, beta,
                                    temperature, gather_fn=_GATHER, log_softmax_fn=_LOG_SOFTMAX, kl_div_fn=_KL_DIV,
                                    **chunk)
    return total


def swift_gkd(gl, vp, student_logits, tp_group, *, teacher_logits, kind="forward_kl", beta=0.5,
              temperature=1.0, chunk_size=-1):
    """ms-swift's `gkd_loss` (`gl`, `gkd_loss.py`) over a full teacher with `vp`'s
    (`vocab_parallel_utils.py`) log-softmax and KL, as `MegatronGKDTrainer.loss_func` passes them,
    one labelled position per call. Needs only torch and the two files: `harness repro --script`
    embeds it."""
    beta, rows, teacher = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(kind, beta), len(student_logits), teacher_logits[None]
    one = [torch.full((1, rows), -100).index_fill(1, torch.tensor([t]), 0) for t in range(rows)]  # labels: position t
    return torch.stack([gl.gkd_loss(student_logits[None], gl.TeacherOutput(full_logits=teacher, labels=y), y, beta, temperature,
                                    log_softmax_fn=vp.vocab_parallel_log_softmax, kl_div_fn=vp.vocab_parallel_kl_div)[0]
                        for y in one])


# `harness repro --script` (the layout of #9580 on: `gkd_loss` with a `TeacherOutput` that holds labels).
if _OUTPUT is None or "labels" in {f.name for f in dataclasses.fields(_OUTPUT)}:
    HARNESS = dataclasses.replace(HARNESS, script={
        "name": "ms-swift", "distill": swift_gkd, "megatron": True, "how": HOW,
        "files": {"gl": "swift/rlhf_trainers/gkd_loss.py", "vp": "swift/megatron/trainers/vocab_parallel_utils.py"}})

# A function whose routine this commit lacks is not defined: the harness checks the others and says so.
if _SPLIT is not None and _TOPK is None:
    del distill_topk
if _SPLIT is not None and _GATHER is None:
    del distill_gather
