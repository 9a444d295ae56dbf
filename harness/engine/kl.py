"""The KL-estimator level's rank side (docs/kl.md): one call of `kl_estimate` as a trainer makes it
(the policy's log-probs a leaf that requires grad, the reference's without), then the backward of the
upstream loss `sum(weight * out)`. Records the output, its flags, the gradient reaching the policy's
log-probs and the inputs' integrity; no collective, no memory meter (O(T) tensors).

Named for its level, as `levels/kl.py` declares it and `cases/kl.py`, `reference/kl.py`, `engine/kl.py`,
`checks/kl.py` and `mutants/kl.py` hold its parts: a level keeps one module name across the layers."""
from __future__ import annotations

from typing import Any

import torch

from harness.cases.kl import KLCase
from harness.engine.calls import grad_context
from harness.engine.executor import _detached, _Integrity
from harness.engine.observations import Observation, TensorMeta
from harness.engine.state_watch import watched
from harness.targets import Target


def run(case: KLCase, target: Target, rank: int, group: Any, device: torch.device, obs: Observation,
        meter_memory: bool = True, cp_rank: int = 0) -> None:
    inp = case.inputs()
    log_probs = inp.log_probs.to(device).requires_grad_(case.requires_grad)
    ref = inp.ref_log_probs.to(device)
    mask = inp.mask.to(device) if inp.mask is not None else None
    integrity = _Integrity(log_probs=log_probs, ref_log_probs=ref, mask=mask)
    fn = target.routine("kl")
    assert fn is not None  # a case runs only at the levels its target has
    with grad_context(case.context):
        with watched("kl forward"):
            out = fn(log_probs, ref, kind=case.kind, mask=mask, reduction=case.reduction, clamp=case.clamp)
        obs.log_prob, obs.log_prob_meta = _detached(out), TensorMeta.of(out)
        obs.integrity = integrity.problems("forward")
        obs.stage = "forward"
    w = inp.weight.to(device)
    if isinstance(out, torch.Tensor) and out.requires_grad and out.shape == w.shape:
        with watched("kl backward"):
            (out * w.to(out.dtype)).sum().backward()
        obs.grad, obs.grad_meta = _detached(log_probs.grad), TensorMeta.of(log_probs.grad)
        obs.integrity += integrity.problems("backward")
    obs.stage = "backward"
