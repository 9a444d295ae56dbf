"""torchtune's chunked knowledge-distillation losses (`ForwardKLWithChunkedOutputLoss`, `ReverseKLWithChunkedOutputLoss`, `torchtune/modules/loss/kd_losses.py`) with the chunked cross entropy its KD recipes mix in (`CEWithChunkedOutputLoss`), at the fused-linear distillation level.

torchtune's KD recipes (`recipes/knowledge_distillation_single_device.py`, `_distributed.py`) give
the student and the teacher `set_num_output_chunks(loss_fn.num_output_chunks)` (`:282-289` single
device), so each model returns its logits as a list: `TransformerDecoder.chunked_output` applies the
output projection to `h.tensor_split(num_output_chunks, dim=1)` (`torchtune/modules/transformer.py:
493-512`; `h.chunk` before torchtune #2560), in the model's dtype. `_loss_step` (`:590-623`) then
calls `kd_loss = kd_loss_fn(logits, teacher_logits, labels)` with the teacher's chunks from a
`torch.no_grad()` forward, `class_loss = loss_fn(logits, labels)`, and `train` (`:660-666`)
backpropagates `(1 - kd_ratio) * class_loss + kd_ratio * kd_loss`, whatever `kd_ratio` is (at 1 the
cross entropy is still computed and multiplied by 0). The labels come shifted by the dataset
(`torchtune/datasets/_sft.py:166-175`), as the contract's are.

The adapter does the same on one sequence (`[1, T, H]`): the student's chunks through the trainer's
own `TransformerDecoder.chunked_output` (compiled alone, on an instance whose `output` is the head,
`F.linear`, as `nn.Linear` and `TiedLinear` apply it), the teacher's chunks the same way under
`torch.no_grad()` with its head (teacher "head") or, with its logits given, `chunked_output` of an
identity output (the same split of the same rows). The chunk count is torchtune's
`num_output_chunks`: `ceil(T / chunk_size)` for a chunked case, the recipes' 8 (the losses'
default, which no KD config changes) for `chunk_size=-1`. `soft_weight` is `kd_ratio` and
`hard_weight` must be `1 - kd_ratio`.

Kinds: torchtune's "forward KL" (`ForwardKLLoss`) sums `-p_t log p_s`, the contract's `soft_ce` (the
KL minus the teacher's entropy); its reverse KL is the contract's `reverse_kl` (a config's `kd_loss`
component may name it: the recipes instantiate whatever it names, `:277-278`; no shipped config does).
No JSD (its `SymmetricKL` mixes the two KLs, a divergence the contract does not have), no forward KL
in the contract's sense, no temperature: declared absent. The reverse KL exists from torchtune #2094
(`6764618d2`) on; before, `reverse_kl` is declared absent.

The classes are compiled alone from their files (`PeerSource.find`), from the torchtune tree on
`PYTHONPATH`; the KD classes need torch only, the cross entropy and `chunked_output` torchtune's
`deprecated` decorator (`torchtune/utils/_logging.py`), compiled from the same tree.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._source import PeerSource

HOW = ("git clone https://github.com/pytorch/torchtune && export PYTHONPATH=$PWD/torchtune:$PYTHONPATH "
       "(its KD losses need torch only)")
SOURCE = PeerSource("torchtune-kd", markers=("torchtune/modules",), how=HOW, files=(
    "torchtune/modules/loss/kd_losses.py", "torchtune/modules/loss/ce_chunked_output_loss.py",
    "torchtune/modules/transformer.py"))
RECIPE_CHUNKS = 8  # CEWithChunkedOutputLoss's num_output_chunks default, which every KD config keeps

_REVERSE = SOURCE.defines("ReverseKLWithChunkedOutputLoss")  # None without torchtune's tree on sys.path

HARNESS = Declaration(
    capabilities={"forward_kl": False, "jsd": False, "temperature": False,
                  **({} if _REVERSE is not False else {"reverse_kl": False})},
    peer=PeerInfo(requires=("torchtune",), install=HOW, upstream=(
        "torchtune.modules.loss.ForwardKLWithChunkedOutputLoss",
        "torchtune.modules.loss.ReverseKLWithChunkedOutputLoss",
        "torchtune.modules.loss.CEWithChunkedOutputLoss",
        "torchtune.modules.TransformerDecoder.chunked_output")),
)

_FKL = SOURCE.find("ForwardKLWithChunkedOutputLoss")  # None without the tree
_RKL = SOURCE.find("ReverseKLWithChunkedOutputLoss") if _REVERSE else None
_CE = SOURCE.find("CEWithChunkedOutputLoss") if _FKL is not None else None
_DECODER = SOURCE.find("TransformerDecoder.chunked_output") if _FKL is not None else None
_KD = {"soft_ce": _FKL, "reverse_kl": _RKL}


def _chunks(x: torch.Tensor, output: Any, n: int) -> list[torch.Tensor]:
    """`TransformerDecoder.chunked_output(x)` of a decoder whose `output` is `output`, with `n` chunks."""
    decoder = SOURCE.require(_DECODER).__new__(_DECODER)
    decoder.output, decoder.num_output_chunks = output, n  # what set_num_output_chunks and __init__ set
    return decoder.chunked_output(x)


def linear_distill_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, *, kind="jsd",
                        beta=0.5, temperature=1.0, ignore_index=-100, hard_weight=0.0, soft_weight=1.0,
                        chunk_size=-1):
    """The KD recipes' `(1 - kd_ratio) * CE + kd_ratio * KD` over the decoder's chunked logits."""
    if kind not in _KD or _KD[kind] is None:
        raise NotImplementedError(f"torchtune has no {kind} distillation loss (HARNESS capabilities)")
    if temperature != 1.0:
        raise NotImplementedError("torchtune's KD losses take no temperature (HARNESS capabilities)")
    if not math.isclose(hard_weight + soft_weight, 1.0, abs_tol=1e-9):
        raise NotImplementedError("torchtune's recipes weigh the losses kd_ratio and 1 - kd_ratio")
    kd_ratio = soft_weight
    T = student_hidden.shape[0]
    n = RECIPE_CHUNKS if chunk_size < 1 else -(-T // chunk_size)
    logits = _chunks(student_hidden.unsqueeze(0), lambda h: F.linear(h, student_weight), n)
    with torch.no_grad():  # the teacher's forward (knowledge_distillation_single_device.py:605-606)
        if teacher_weight is None:
            teacher_logits = _chunks(teacher_hidden.unsqueeze(0), lambda t: t, n)
        else:
            teacher_logits = _chunks(teacher_hidden.unsqueeze(0), lambda h: F.linear(h, teacher_weight), n)
    batch_labels = labels.unsqueeze(0)
    kd_loss_fn = SOURCE.require(_KD[kind])(num_output_chunks=n, ignore_index=ignore_index)
    loss_fn = SOURCE.require(_CE)(num_output_chunks=n, ignore_index=ignore_index)
    kd_loss = kd_loss_fn(logits, teacher_logits, batch_labels)
    class_loss = loss_fn(logits, batch_labels)
    return (1 - kd_ratio) * class_loss + kd_ratio * kd_loss


def torchtune_kd(kd, ce, student_hidden, student_weight, teacher_hidden, teacher_weight, labels, *, kind="jsd",
                 soft_weight=1.0, chunk_size=-1):
    """The KD recipes' `(1 - kd_ratio) * CE + kd_ratio * KD` (`kd`: `kd_losses.py`, `ce`:
    `ce_chunked_output_loss.py`) over the decoder's chunked logits (`TransformerDecoder.chunked_output`'s
    `tensor_split`): `harness repro --script` embeds it."""
    n = 8 if chunk_size < 1 else -(-len(labels) // chunk_size)  # the recipes' num_output_chunks, or the case's
    s = [torch.nn.functional.linear(h, student_weight) for h in student_hidden[None].tensor_split(n, dim=1)]  # chunked_output
    t = [h.detach() if teacher_weight is None else torch.nn.functional.linear(h, teacher_weight).detach() for h in teacher_hidden[None].tensor_split(n, dim=1)]  # noqa: E501
    return (1 - soft_weight) * ce.CEWithChunkedOutputLoss(num_output_chunks=n)(s, labels[None]) + soft_weight * {"soft_ce": kd.ForwardKLWithChunkedOutputLoss, "reverse_kl": kd.ReverseKLWithChunkedOutputLoss}[kind](num_output_chunks=n)(s, t, labels[None])  # noqa: E501


# `harness repro --script` (main's layout: the decoder's tensor_split, from torchtune #2560 on).
HARNESS = dataclasses.replace(HARNESS, script={
    "name": "torchtune", "linear_distill": torchtune_kd, "how": HOW,
    "files": {"kd": "torchtune/modules/loss/kd_losses.py", "ce": "torchtune/modules/loss/ce_chunked_output_loss.py"},
    "stubs": {"torchtune.utils": {"deprecated": "lambda *a, **k: (lambda c: c)"},
              "torchtune.modules.loss.loss_types": {"SFTLoss": "object"}}})
