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

The files are loaded on their own (`_source`): `swift/__init__.py` imports transformers, peft and
Megatron-LM's training code; these three need torch and `megatron.core.mpu` only, so nothing is
stubbed. The TP group is `parallel_state`'s (the adapter checks it is the harness's).

Its trainer's use: the teacher's logits come detached (`gkd_trainer.py:259-260`: a forward under
`torch.no_grad()`), so a differentiable teacher is beyond it; `gkd_logits_topk` is a positive k
(`swift/megatron/arguments/megatron_args.py:243-245`) that a shard of a real vocabulary holds many
times over. `HARNESS_USE` lists the cases beyond its use.
"""
from __future__ import annotations

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._mpu import parallel_state_group
from harness.targets.peers._source import PeerSource, missing

HOW = ("git clone https://github.com/modelscope/ms-swift && export PYTHONPATH=$PWD/ms-swift:$PYTHONPATH "
       "(gkd_loss.py, gkd_utils.py and vocab_parallel_utils.py need torch and megatron-core only)")
_MARKERS = ("swift/megatron",)
VOCAB = PeerSource("ms-swift-vocab-parallel", files=("swift/megatron/trainers/vocab_parallel_utils.py",),
                   markers=_MARKERS, how=HOW)
UTILS = PeerSource("ms-swift-gkd-utils", files=("swift/megatron/trainers/gkd_utils.py",), markers=_MARKERS, how=HOW)
LOSS = PeerSource("ms-swift-gkd-loss", files=("swift/rlhf_trainers/gkd_loss.py",), markers=_MARKERS, how=HOW)
HARNESS = Declaration(
    capabilities={"mixed": False, "soft_ce": False, "unnormalized": False},
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

_VP, _GU, _GL = VOCAB.load(), UTILS.load(), LOSS.load()
if _VP is not None and _GU is not None and _GL is not None:
    missing(VOCAB, _VP, "vocab_parallel_log_softmax", "vocab_parallel_kl_div")
    missing(UTILS, _GU, "vocab_parallel_topk", "tp_gather_topk")
    missing(LOSS, _GL, "gkd_loss", "TeacherOutput")

_BETA = {"forward_kl": 0.0, "reverse_kl": 1.0}


def _group(tp_group) -> None:
    parallel_state_group(tp_group, "ms-swift's GKD utilities")


def distill_log_softmax(logits, tp_group, temperature=1.0, chunk_size=-1):
    """`vocab_parallel_log_softmax(logits / temperature)`: this rank's shard, in the logits' dtype."""
    _group(tp_group)
    return VOCAB.require(_VP).vocab_parallel_log_softmax(logits / temperature)


def distill_topk(logits, k, tp_group, temperature=1.0, chunk_size=-1):
    """`vocab_parallel_topk` of the log-softmax shard: `(log_probs [T, k], ids [T, k])`."""
    _group(tp_group)
    log_probs = VOCAB.require(_VP).vocab_parallel_log_softmax(logits / temperature)
    values, ids = UTILS.require(_GU).vocab_parallel_topk(log_probs, k=k)
    return values, ids


def distill_gather(logits, indices, tp_group, temperature=1.0, chunk_size=-1, renormalize=False):
    """`tp_gather_topk` of the divided logits, log-softmaxed over the support (gkd_loss's top-k path)."""
    if not renormalize:
        raise NotImplementedError("ms-swift renormalizes over a top-k support (HARNESS_CAPABILITIES)")
    _group(tp_group)
    gathered = UTILS.require(_GU).tp_gather_topk(logits, indices.to(torch.int64))
    return torch.nn.functional.log_softmax(gathered / temperature, dim=-1)


def distill_divergence(student_logits, tp_group, *, teacher_logits=None, teacher_topk_log_probs=None,
                       teacher_topk_indices=None, k=0, kind="forward_kl", beta=0.5, temperature=1.0,
                       renormalize=True, chunk_size=-1):
    """`gkd_loss` per position: the generalized JSD (or a KL) of one labelled position per call."""
    if not renormalize:
        raise NotImplementedError("ms-swift renormalizes over a top-k support (HARNESS_CAPABILITIES)")
    _group(tp_group)
    vp, gu, gl = VOCAB.require(_VP), UTILS.require(_GU), LOSS.require(_GL)
    beta = _BETA.get(kind, beta)
    if teacher_logits is not None and k <= 0:
        teacher = dict(full_logits=teacher_logits.unsqueeze(0))
    elif teacher_logits is not None:  # a local teacher's top-k (gkd_trainer.py:262-264)
        values, ids = gu.vocab_parallel_topk(teacher_logits.unsqueeze(0), k=k)
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
        total, _ = gl.gkd_loss(student, gl.TeacherOutput(**teacher, labels=labels), labels, beta, temperature,
                               gather_fn=gu.tp_gather_topk, log_softmax_fn=vp.vocab_parallel_log_softmax,
                               kl_div_fn=vp.vocab_parallel_kl_div,
                               **({"chunk_size": chunk_size} if chunk_size > 0 else {}))
        per_token.append(total)
    if not per_token:  # no position: an empty result that follows the logits' autograd state
        return student_logits.float().sum(-1)
    return torch.stack(per_token)
