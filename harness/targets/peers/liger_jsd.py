"""Liger-Kernel's chunked fused-linear JSD (`src/liger_kernel/chunked_loss/jsd_loss.py::LigerFusedLinearJSDLoss`
over `fused_linear_distillation.py::LigerFusedLinearDistillationBase`), as TRL's distillation trainers build and call it.

TRL's trainers with `use_liger_kernel` build `LigerFusedLinearJSDLoss(beta=args.beta, ignore_index=-100,
temperature=args.temperature, compiled=False, weight_hard_loss=0.0, weight_soft_loss=1.0)` and call it on the
student's and the teacher's last hidden states and LM heads (`student_bias` / `teacher_bias` the heads' biases,
None for the models' bias-free heads): `trl/experimental/distillation/distillation_trainer.py:375-382` (the loss),
`1039-1044` (hidden states flattened to `[B*T, H]`, labels to `[B*T]`), `1049-1057` (the call); GKD's
`trl/experimental/gkd/gkd_trainer.py:149-155` (no temperature) and `372-380` (hidden states `[B, T, H]`), GOLD's
`gold/gold_trainer.py:926-933, 2541-2549` and IW-OPD's `iw_opd/iw_opd_trainer.py:492-499, 1736-1744` the same
(TRL at `f2cd57710`, 1.10.0.dev0; TRL 1.16.0 has no Liger path in its distillation trainers). ms-swift's HF GKD
trainer makes the same call with Liger's default weights, 0.5 each (`swift/rlhf_trainers/gkd_trainer.py:463-468`,
`194-202`, at `3602360a5`). The adapter makes that call on `[T, H]` hidden states, as TRL's distillation trainer
does, with the contract's arguments in the caller's keywords:

- `kind`: `jsd` is the loss's `beta` (`m = (1 - beta) s + beta t`, `jsd_loss.py:39-47`); `forward_kl` and
  `reverse_kl` are `beta` 0 and 1, the loss's own branches `F.kl_div(log s, log t)` = KL(t || s) and
  `F.kl_div(log t, log s)` = KL(s || t) (`jsd_loss.py:33-36`). No soft cross-entropy.
- `hard_weight` / `soft_weight`: `weight_hard_loss` / `weight_soft_loss` (the hard loss is the student's
  cross-entropy at temperature 1, `fused_linear_distillation.py:54-62`); `temperature` divides both chunks'
  logits (`:119-120`).
- `chunk_size`: the loss's `chunk_size` (it splits the tokens into `max(1, T // chunk_size)` chunks with
  `torch.chunk`, `:271-274`); at -1 the caller's default (1024: one chunk for the cases' T), as TRL passes none.
- The teacher: its hidden states and head only (the loss makes its logits, `:49-52`); no teacher logits.
- `compiled=False`, as every TRL caller passes (the class's default `True` compiles `accumulate_chunk` with
  `torch.compile`: on CPU it runs, at about a minute of compiling per call signature).

The two files are compiled alone (`_source.PeerSource`), never imported through the package: `chunked_loss/__init__.py`
imports every chunked loss of Liger, and a commit's tree holds them under `src/`. The base class is compiled from its
own file and provided to `jsd_loss.py` as the name it imports. Older layouts: before #599
(`9a5d7ba5`) the loss takes no `chunk_size` (declared absent there); before #590 (`740de2b4`) no biases (none
passed). `jsd_loss.py` exists from #425 (`aa2d23dc`) on.
"""
from __future__ import annotations

import dataclasses
import inspect

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._source import PeerSource

HOW = ("git clone https://github.com/linkedin/Liger-Kernel && export PYTHONPATH=$PWD/Liger-Kernel/src:$PYTHONPATH "
       "(its chunked JSD needs torch only; the two files are compiled alone, the package is never imported)")
_CHUNKED = "liger_kernel/chunked_loss"
_MARKERS = (_CHUNKED, f"src/{_CHUNKED}")  # the `src/` folder on PYTHONPATH, or the repository's root (a commit)
_BASE_SOURCE = PeerSource("liger-jsd-base", markers=_MARKERS, how=HOW,
                          files=(f"{_CHUNKED}/fused_linear_distillation.py", f"src/{_CHUNKED}/fused_linear_distillation.py"))
_BASE = _BASE_SOURCE.find("LigerFusedLinearDistillationBase")  # None without Liger's tree on sys.path
# `jsd_loss.py` imports the base from `liger_kernel.chunked_loss.fused_linear_distillation`: the class compiled above.
SOURCE = PeerSource("liger-jsd", markers=_MARKERS, how=HOW, provides={"LigerFusedLinearDistillationBase": _BASE},
                    files=(f"{_CHUNKED}/jsd_loss.py", f"src/{_CHUNKED}/jsd_loss.py"))
_LOSS = SOURCE.find("LigerFusedLinearJSDLoss") if _BASE is not None else None
_INIT = set(inspect.signature(_LOSS.__init__).parameters) if _LOSS is not None else set()
_CALL = set(inspect.signature(_LOSS.forward).parameters) if _LOSS is not None else set()
_TAKES_CHUNK = _LOSS is None or "chunk_size" in _INIT

HARNESS = Declaration(
    capabilities={"soft_ce": False, "teacher_logits": False, **({} if _TAKES_CHUNK else {"chunk_size": False})},
    peer=PeerInfo(requires=("liger_kernel",), install=HOW, upstream=(
        "liger_kernel.chunked_loss.jsd_loss.LigerFusedLinearJSDLoss",
        "liger_kernel.chunked_loss.fused_linear_distillation.LigerFusedLinearDistillationBase")),
    # Every input the level draws is some caller's: TRL's trainers pass weight_hard_loss=0.0 (see above), while
    # ms-swift's HF GKD trainer keeps Liger's default mix, 0.5 * CE + 0.5 * JSD (swift/rlhf_trainers/gkd_trainer.py:
    # 463-468 at 3602360a5, with temperature=self.temperature), so the hard loss is in use too.
    use=[],
)

_BETA = {"forward_kl": 0.0, "reverse_kl": 1.0}


def linear_distill_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, *, kind="jsd",
                        beta=0.5, temperature=1.0, ignore_index=-100, hard_weight=0.0, soft_weight=1.0,
                        chunk_size=-1):
    """`LigerFusedLinearJSDLoss(...)(student_input=..., ...)` as TRL's distillation trainer calls it."""
    loss_cls = SOURCE.require(_LOSS)
    if kind == "soft_ce":
        raise NotImplementedError("Liger's fused-linear JSD has no soft cross-entropy (HARNESS capabilities)")
    if teacher_weight is None:
        raise NotImplementedError("Liger's fused-linear JSD takes the teacher's hidden states and head, not its logits")
    kw = dict(beta=_BETA.get(kind, beta), ignore_index=ignore_index, temperature=temperature, compiled=False,
              weight_hard_loss=hard_weight, weight_soft_loss=soft_weight)
    if chunk_size > 0:
        if "chunk_size" not in _INIT:
            raise NotImplementedError("this commit's LigerFusedLinearJSDLoss takes no chunk_size (HARNESS capabilities)")
        kw["chunk_size"] = chunk_size
    bias = {"student_bias": None, "teacher_bias": None} if "student_bias" in _CALL else {}
    return loss_cls(**kw)(student_input=student_hidden, student_weight=student_weight, teacher_input=teacher_hidden,
                          teacher_weight=teacher_weight, true_labels=labels, **bias)



def liger_jsd(base, jsd, student_hidden, student_weight, teacher_hidden, teacher_weight, labels, *, kind="jsd",
              beta=0.5, temperature=1.0, hard_weight=0.0, soft_weight=1.0, chunk_size=-1):
    """`LigerFusedLinearJSDLoss` (`jsd`, over `base`'s chunked distillation) as TRL's distillation trainer
    builds and calls it, eager: `harness repro --script` embeds it."""
    chunks, beta = {"chunk_size": chunk_size} if chunk_size > 0 else {}, {"forward_kl": 0.0, "reverse_kl": 1.0}.get(kind, beta)
    return jsd.LigerFusedLinearJSDLoss(beta=beta, temperature=temperature, compiled=False, weight_hard_loss=hard_weight, weight_soft_loss=soft_weight, **chunks)(  # noqa: E501
        student_input=student_hidden, student_weight=student_weight, teacher_input=teacher_hidden, teacher_weight=teacher_weight, true_labels=labels)  # noqa: E501


# `harness repro --script` (the layout with a chunk size and biases: #599 on), the `src/` folder on PYTHONPATH.
if _LOSS is None or ("chunk_size" in _INIT and "student_bias" in _CALL):
    HARNESS = dataclasses.replace(HARNESS, script={"name": "Liger-Kernel", "linear_distill": liger_jsd, "how": HOW, "files": {
        "base": f"{_CHUNKED}/fused_linear_distillation.py", "jsd": f"{_CHUNKED}/jsd_loss.py"}})
