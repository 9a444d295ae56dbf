"""SkyRL's multi-token-prediction draft losses (`skyrl/backends/skyrl_train/mtp/soft_ce.py`: `draft_soft_ce_topk` over `_VocabParallelTopkSoftCE`, `draft_soft_ce` over `_VocabParallelSoftCrossEntropy`), as its Megatron worker composes them.

The worker (`skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py:719-773`) distills
each MTP head (the student) from the policy's own detached next-token logits (the teacher): with
`mtp_loss_topk` set, `draft_soft_ce_topk(student_logits, teacher_src, layer_mask, k,
vocab_parallel_group=tp_grp, roll_shift=layer_idx + 1)`, the soft cross-entropy over the teacher's
top-k with both sides renormalized over it; otherwise `draft_soft_ce(student_logits,
build_teacher_logits(teacher_src, layer_idx), layer_mask, vocab_parallel_group=tp_grp,
chunk_size=mtp_loss_chunk_size)` over the whole vocabulary. Each returns a masked mean over the
positions; the adapter labels one position per call (a one-hot mask) and stacks the T results, the
per-token soft cross-entropy `distill_divergence` returns (`kind` `soft_ce`; `topk` and `full`
teachers; no temperature, which the worker undoes before (`:735`)). The top-k path takes its
teacher un-rolled, as the worker hands it: the adapter puts a placeholder row before the teacher's
rows and one after the student's, so `roll_shift=1` (MTP depth 0) aligns row t with row t.

The two functions are found by what they are (`_source.PeerSource.find`): `draft_soft_ce_topk` and
`draft_soft_ce` in `skyrl/backends/skyrl_train/mtp/soft_ce.py`, each compiled alone with the names
it reads. Nothing is stubbed: `masked_mean` comes from `skyrl/backends/skyrl_train/utils/torch_utils.py`,
read as a file (its module's other imports, jaxtyping and flash-attn, are never reached), and is not
called where a global normalisation factor is passed, as the adapter always does (a factor of 1,
the one-hot mask's count).

Its trainer's use: the teacher is always detached (`soft_ce.py:17-20` asserts it), so
`HARNESS_CAPABILITIES` has no differentiable teacher; the logits are the models' raw outputs, never
-inf (padded vocabulary columns are sliced off first, `megatron_model_wrapper.py:740-746`);
`mtp_loss_topk` is far below a shard's width. `HARNESS_USE` lists the cases beyond its use.
"""
from __future__ import annotations

import dataclasses

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._source import PeerSource

HOW = ("git clone https://github.com/NovaSky-AI/SkyRL && export PYTHONPATH=$PWD/SkyRL:$PYTHONPATH "
       "(mtp/soft_ce.py needs torch only)")
SOURCE = PeerSource("SkyRL-mtp", files=("skyrl/backends/skyrl_train/mtp/soft_ce.py",),
                    markers=("skyrl/backends",), how=HOW)
HARNESS = Declaration(
    capabilities={"distill_log_softmax": False, "distill_topk": False, "distill_gather": False,
                  "given_teacher": False, "forward_kl": False, "reverse_kl": False, "jsd": False,
                  "mixed": False, "unnormalized": False, "teacher_grad": False, "temperature": False},
    peer=PeerInfo(requires=("skyrl",), install=HOW, upstream=(
        "skyrl.backends.skyrl_train.mtp.soft_ce.draft_soft_ce_topk",
        "skyrl.backends.skyrl_train.mtp.soft_ce.draft_soft_ce")),
    use=[
        {"where": {"regime": "neginf"},
         "why": "the policy's and the MTP heads' logits are raw model outputs, the padded vocabulary's columns sliced "
                "off first: skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py:740-746"},
    ],
)

# None without SkyRL's tree on sys.path; RoutineMissing when this commit has no such function
_TOPK, _FULL = SOURCE.find("draft_soft_ce_topk"), SOURCE.find("draft_soft_ce")


def distill_divergence(student_logits, tp_group, *, teacher_logits=None, teacher_topk_log_probs=None,
                       teacher_topk_indices=None, k=0, kind="forward_kl", beta=0.5, temperature=1.0,
                       renormalize=True, chunk_size=-1):
    """The per-token soft cross-entropy of `draft_soft_ce_topk` (k > 0) or `draft_soft_ce` (k <= 0)."""
    if kind != "soft_ce" or teacher_logits is None or temperature != 1.0 or not renormalize:
        raise NotImplementedError("SkyRL's draft losses are soft cross-entropies from teacher logits, "
                                  "renormalized over a top-k, without temperature (HARNESS_CAPABILITIES)")
    rows, v_local = student_logits.shape
    one = torch.ones((), device=student_logits.device)
    if k > 0:  # the worker's un-rolled teacher and roll_shift = 1: a placeholder row on each side
        student = torch.cat([student_logits, student_logits.new_zeros((1, v_local))]).unsqueeze(0)
        teacher = torch.cat([teacher_logits.new_zeros((1, v_local)), teacher_logits]).unsqueeze(0)
    else:
        student, teacher = student_logits.unsqueeze(0), teacher_logits.unsqueeze(0)
    per_token = []
    for t in range(rows):
        mask = torch.zeros(student.shape[:2], device=student.device)
        mask[0, t] = 1.0
        if k > 0:
            loss = SOURCE.require(_TOPK)(student, teacher, mask, k, global_normalization_factor=one,
                                         vocab_parallel_group=tp_group, roll_shift=1)
        else:
            loss = SOURCE.require(_FULL)(student, teacher, mask, global_normalization_factor=one,
                                    vocab_parallel_group=tp_group, chunk_size=chunk_size if chunk_size > 0 else None)
        per_token.append(loss)
    if not per_token:
        return student_logits.float().sum(-1)
    return torch.stack(per_token)


def skyrl_draft_soft_ce(sc, student_logits, tp_group, *, teacher_logits, chunk_size=-1):
    """SkyRL's call of `draft_soft_ce` (of `sc`, its `mtp/soft_ce.py`) as its Megatron worker makes it
    without `mtp_loss_topk`: the whole vocabulary's soft cross-entropy of the MTP head's logits from the
    policy's detached ones, one labelled position per call (a one-hot mask, a normalisation factor of 1),
    the T results stacked. Needs only torch and `sc`: `harness repro --script` embeds it. Only the full
    teacher: the distillation level's scripts take no top-k one."""
    if not len(student_logits):  # no position: an empty result that follows the logits' autograd state
        return student_logits.float().sum(-1)
    one, chunk = torch.ones((), device=student_logits.device), chunk_size if chunk_size > 0 else None
    masks = torch.eye(len(student_logits), device=student_logits.device)[:, None]  # row t: position t alone
    return torch.stack([sc.draft_soft_ce(student_logits[None], teacher_logits[None], mask, global_normalization_factor=one,
                                         vocab_parallel_group=tp_group, chunk_size=chunk) for mask in masks])


# `harness repro --script`: the file the call needs from SkyRL's tree, and the call itself. The file imports
# `masked_mean` from SkyRL's package (`skyrl/backends/skyrl_train/utils/torch_utils.py`), whose `__init__`s import
# SkyRL's own dependencies: the script runs where SkyRL is installed with them.
HARNESS = dataclasses.replace(HARNESS, script={
    "name": "SkyRL", "files": {"sc": SOURCE.files}, "distill": skyrl_draft_soft_ce,
    "how": HOW.replace("(mtp/soft_ce.py needs torch only)", "(soft_ce.py imports SkyRL's package: install its dependencies)")})
