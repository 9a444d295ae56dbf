"""TRL's GKD loss (`GKDTrainer.generalized_jsd_loss`, `trl/experimental/gkd/gkd_trainer.py`; `trl/trainer/gkd_trainer.py` before TRL #4474) as `GKDTrainer.compute_loss` calls it, at the fused-linear distillation level.

`compute_loss` (`trl/experimental/gkd/gkd_trainer.py:324-361` in trl 1.16.0) runs the student and,
under `torch.no_grad()`, the teacher on the same inputs, takes their whole logits (the models' LM
heads, unchunked, in the models' dtype), shifts them by one against the labels
(`logits[:, :-1]`, `labels[:, 1:]`: the contract's labels come aligned, so the adapter's shift is
the identity) and calls `generalized_jsd_loss(student_logits=..., teacher_logits=..., labels=...,
beta=self.beta, num_items_in_batch=num_items_in_batch)`: no temperature (the loss's default 1;
`args.temperature` is the on-policy generation's, `:198`, `:217`) and the default
`reduction="batchmean"`. `num_items_in_batch` is transformers' `Trainer`'s count of the labels that
are not -100 over `labels[..., 1:]` of the accumulated micro-batches (`transformers/trainer.py:
2123-2160`, passed where the model's forward takes loss kwargs, as a causal LM's does): on one
micro-batch, the contract's valid tokens. The adapter reads the keywords `compute_loss` passes from
the commit's own source (`num_items_in_batch` from TRL #6006 on), and passes the same.

The loss's `beta` is the contract's: 0 is its forward KL (`F.kl_div(student_log_probs,
teacher_log_probs)` = KL(t || s)), 1 its reverse KL, between them the generalized JSD with the
mixture `beta t + (1 - beta) s` (TRL #3043 on; before it the mixture's weights were swapped and
beta 0 and 1 had no branch of their own). The adapter asks `forward_kl` as beta 0, `reverse_kl` as
beta 1. Declared absent: `soft_ce`, `temperature` (compute_loss passes none), `hard_loss` (GKD mixes
no cross entropy), `chunk_size` (whole logits). The student's logits are `F.linear` of its hidden
states and head (an `nn.Linear` without bias, as a causal LM's `lm_head`), the teacher's the same
under `torch.no_grad()` (teacher "head") or its logits as given.

The method is compiled alone from its file (`PeerSource.find`): the trainer's module imports
transformers, datasets and accelerate, which the loss never calls. It comes from the TRL tree on
`PYTHONPATH`, else the installed trl.
"""
from __future__ import annotations

import ast
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._source import PeerSource

HOW = "pip install trl==1.16.0, or a TRL tree on PYTHONPATH (its GKD loss needs torch only)"
SOURCE = PeerSource("trl-gkd", markers=("trl/trainer",), how=HOW, files=(
    "trl/experimental/gkd/gkd_trainer.py", "trl/trainer/gkd_trainer.py"))
_METHOD = "GKDTrainer.generalized_jsd_loss"

HARNESS = Declaration(
    capabilities={"soft_ce": False, "temperature": False, "hard_loss": False, "chunk_size": False},
    peer=PeerInfo(requires=("trl",), install=HOW, upstream=(
        "trl.experimental.gkd.gkd_trainer.GKDTrainer.generalized_jsd_loss",)),
)

_LOSS = SOURCE.find(_METHOD)  # the lean trainer class holding the static method; None without TRL


def _passed() -> set[str]:
    """The keywords `GKDTrainer.compute_loss` passes to `generalized_jsd_loss`, read from the commit's file."""
    roots = SOURCE.roots()
    for rel in SOURCE.files:
        path = roots[0] / rel
        if not path.is_file():
            continue
        for node in ast.parse(path.read_text(encoding="utf-8", errors="replace")).body:
            if not (isinstance(node, ast.ClassDef) and node.name == "GKDTrainer"):
                continue
            for method in node.body:
                if isinstance(method, ast.FunctionDef) and method.name == "compute_loss":
                    return {k.arg for call in ast.walk(method) if isinstance(call, ast.Call)
                            and isinstance(call.func, ast.Attribute) and call.func.attr == "generalized_jsd_loss"
                            for k in call.keywords if k.arg}
    return set()


_KEYWORDS = _passed() if _LOSS is not None else set()
_BETA = {"forward_kl": 0.0, "reverse_kl": 1.0}


def linear_distill_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, *, kind="jsd",
                        beta=0.5, temperature=1.0, ignore_index=-100, hard_weight=0.0, soft_weight=1.0,
                        chunk_size=-1):
    """`compute_loss`'s call of `generalized_jsd_loss` on one sequence's whole logits."""
    if kind not in ("jsd", *_BETA) or temperature != 1.0 or hard_weight != 0.0 or soft_weight != 1.0:
        raise NotImplementedError("TRL's GKD loss is the generalized JSD at temperature 1, alone (HARNESS capabilities)")
    if ignore_index != -100:
        raise NotImplementedError("TRL's GKD loss masks the labels that are -100")
    student_logits = F.linear(student_hidden, student_weight).unsqueeze(0)  # the student's lm_head
    with torch.no_grad():  # the teacher's forward (gkd_trainer.py:332-337)
        teacher_logits = (teacher_hidden if teacher_weight is None else F.linear(teacher_hidden, teacher_weight))
        teacher_logits = teacher_logits.unsqueeze(0)
    kwargs: dict[str, Any] = {"beta": _BETA.get(kind, beta)}
    if "labels" in _KEYWORDS:
        kwargs["labels"] = labels.unsqueeze(0)
    if "num_items_in_batch" in _KEYWORDS:  # transformers' Trainer: labels[..., 1:].ne(-100).sum()
        kwargs["num_items_in_batch"] = labels.ne(-100).sum()
    unknown = _KEYWORDS - {"student_logits", "teacher_logits", "labels", "beta", "num_items_in_batch"}
    if unknown:
        raise NotImplementedError(f"this commit's compute_loss passes {sorted(unknown)}, which the adapter "
                                  "does not map")
    return SOURCE.require(_LOSS).generalized_jsd_loss(student_logits=student_logits, teacher_logits=teacher_logits,
                                                      **kwargs)


def trl_gkd(gkd, student_hidden, student_weight, teacher_hidden, teacher_weight, labels, *, kind="jsd", beta=0.5):
    """`GKDTrainer.compute_loss`'s call of `generalized_jsd_loss` (`gkd`: TRL's `gkd_trainer` module) on
    one sequence's logits, with the Trainer's count of valid labels: `harness repro --script` embeds it."""
    s = torch.nn.functional.linear(student_hidden, student_weight)[None]  # the student's lm_head
    t = (teacher_hidden if teacher_weight is None else torch.nn.functional.linear(teacher_hidden, teacher_weight))[None]
    return gkd.GKDTrainer.generalized_jsd_loss(s, t.detach(), labels=labels[None], beta={"forward_kl": 0.0, "reverse_kl": 1.0}.get(kind, beta),  # noqa: E501
                                               num_items_in_batch=labels.ne(-100).sum())


# `harness repro --script` (main's layout: the trainer under trl.experimental, compute_loss passing the count).
if _KEYWORDS >= {"labels", "num_items_in_batch"}:
    HARNESS = dataclasses.replace(HARNESS, script={
        "name": "TRL", "linear_distill": trl_gkd, "how": HOW, "files": {"gkd": "trl.experimental.gkd.gkd_trainer"}})
