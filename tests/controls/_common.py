"""Plumbing shared by the controls: the Level 1 entry point, group resolution, row chunks.

Only bookkeeping lives here; every numerical step is in the control's own module so that the
controls stay algorithmically independent of each other. `kernel_entry(algorithm)` is the contract's
Level 1 function around a control's algorithm: it normalises the arguments, resolves the group and
applies the contract's gradient rule once, so a control is only `algorithm(logits, call)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

Result = tuple[torch.Tensor, Optional[torch.Tensor]]


@dataclass(frozen=True)
class Call:
    """One Level 1 call, normalised: what a control's algorithm reads besides the logits."""

    tokens: torch.Tensor  # int64 [T], global vocab ids
    keep: Optional[torch.Tensor]  # bool [T, V_local], or None
    group: object  # the TP group (None on a single rank)
    world: int
    start: int  # the first global vocab id of this rank's shard
    chunks: list[tuple[int, int]]  # [s, e) row ranges
    with_entropy: bool
    needs: bool  # the log-prob is differentiable
    ent_grad: bool  # the entropy is differentiable (the contract's rule)


def kernel_entry(algorithm: Callable[[torch.Tensor, Call], Result]) -> Callable[..., Result]:
    """`calculate_log_probs_and_entropy` with the contract's signature, computing with `algorithm`
    (a plain function or an autograd Function's `apply`)."""
    def calculate_log_probs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor, tp_group,
                                        with_entropy: bool = False, chunk_size: int = -1,
                                        log_prob_keep_mask: Optional[torch.Tensor] = None,
                                        with_entropy_grad: bool = True) -> Result:
        tokens, keep = normalise(logits, tokens, log_prob_keep_mask)
        group, world, rank = group_info(tp_group)
        needs, ent_grad = grad_mode(logits, with_entropy, with_entropy_grad)
        return algorithm(logits, Call(tokens, keep, group, world, rank * logits.shape[-1],
                                      row_chunks(logits.shape[0], chunk_size), bool(with_entropy), needs,
                                      ent_grad))
    return calculate_log_probs_and_entropy


def group_info(tp_group) -> tuple[object, int, int]:
    """(group, world size, rank); a single rank when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, 1, 0
    return tp_group, dist.get_world_size(tp_group), dist.get_rank(tp_group)


def row_chunks(num_rows: int, chunk_size: Optional[int]) -> list[tuple[int, int]]:
    """[s, e) row ranges; none at all for T == 0, so every rank issues no collective then."""
    step = num_rows if chunk_size is None or chunk_size <= 0 else int(chunk_size)
    return [(s, min(s + step, num_rows)) for s in range(0, num_rows, max(step, 1))]


def normalise(logits: torch.Tensor, tokens: torch.Tensor, keep_mask: Optional[torch.Tensor]):
    """Targets as int64 [T] and the mask as bool on the logits' device (no copy when already so)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V_local], got {tuple(logits.shape)}")
    tokens = tokens.reshape(-1).to(device=logits.device, dtype=torch.long)
    if keep_mask is not None:
        keep_mask = keep_mask.to(device=logits.device, dtype=torch.bool)
    return tokens, keep_mask


def grad_mode(logits: torch.Tensor, with_entropy: bool, with_entropy_grad: bool) -> tuple[bool, bool]:
    """(log-prob differentiable, entropy differentiable) per the contract's rule."""
    needs = bool(logits.requires_grad and torch.is_grad_enabled())
    return needs, bool(with_entropy and with_entropy_grad and needs)


def effective_keep(keep: torch.Tensor, local: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """A new mask with this shard's target entries forced to kept (the caller's is never written)."""
    rows = torch.arange(keep.shape[0], device=keep.device)
    hit = torch.zeros_like(keep)
    hit[rows[own], local[own]] = True
    return keep | hit


def chunk_inputs(logits: torch.Tensor, tokens: torch.Tensor, keep: Optional[torch.Tensor], s: int, e: int,
                 start: int) -> tuple:
    """Rows [s, e) in float32, the shard-local targets, which of them this shard owns, and the
    keep-masked rows (None without a mask). The float32 rows may alias a float32 input."""
    x = logits[s:e].to(torch.float32)
    local = tokens[s:e] - start
    own = (local >= 0) & (local < x.shape[-1])
    xm = None if keep is None else x.masked_fill(~effective_keep(keep[s:e], local, own), float("-inf"))
    return x, local, own, xm
