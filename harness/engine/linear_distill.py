"""The fused-linear distillation level's rank side (docs/linear-distill.md): one call of
`linear_distill_loss` as a trainer's distillation step makes it (the student's hidden states and
head leaves that require grad, the teacher's inputs without), then the backward of `weight * loss`.
Records the loss, its flags, the gradients reaching the student's hidden states and head, and the
inputs' integrity.

Named for its level, as `levels/linear_distill.py` declares it and `cases/`, `reference/`, `checks/`,
`targets/fused_linear_distill.py` and `mutants/linear_distill.py` hold its parts."""
from __future__ import annotations

from typing import Any

import torch

from harness.cases.linear_distill import IGNORE_INDEX, LinearDistillCase
from harness.engine.executor import _detached, _Integrity
from harness.engine.observations import Observation, TensorMeta
from harness.engine.state_watch import watched
from harness.targets import Target


def run(case: LinearDistillCase, target: Target, rank: int, group: Any, device: torch.device, obs: Observation,
        meter_memory: bool = True, cp_rank: int = 0) -> None:
    inp = case.inputs()
    hidden = inp.student_hidden.to(device).requires_grad_(True)
    weight = inp.student_weight.to(device).requires_grad_(True)
    # The teacher's inputs without autograd history, as a trainer's teacher pass under no_grad makes them.
    t_hidden = inp.teacher_hidden.to(device)
    t_weight = inp.teacher_weight.to(device) if inp.teacher_weight is not None else None
    labels = inp.labels.to(device)
    integrity = _Integrity(student_hidden=hidden, student_weight=weight, teacher_hidden=t_hidden,
                           teacher_weight=t_weight, labels=labels)
    fn = target.routine("linear_distill")
    assert fn is not None  # a case runs only at the levels its target has
    with watched("linear_distill forward"):
        loss = fn(hidden, weight, t_hidden, t_weight, labels, kind=case.kind, beta=case.beta,
                  temperature=case.temperature, ignore_index=IGNORE_INDEX, hard_weight=case.hard_weight,
                  soft_weight=case.soft_weight, chunk_size=case.chunk_size)
    obs.log_prob, obs.log_prob_meta = _detached(loss), TensorMeta.of(loss)
    obs.integrity = integrity.problems("forward")
    obs.stage = "forward"
    if isinstance(loss, torch.Tensor) and loss.requires_grad and loss.dim() == 0:
        with watched("linear_distill backward"):
            (loss * inp.weight).backward()
        obs.grad, obs.grad_meta = _detached(weight.grad), TensorMeta.of(weight.grad)
        obs.grad_hidden, obs.grad_hidden_meta = _detached(hidden.grad), TensorMeta.of(hidden.grad)
        obs.integrity += integrity.problems("backward")
    obs.stage = "backward"
