"""The Level 2 wrapper shared by every control: `make_wrapper(kernel)` binds any Level 1 kernel.

Top-p replay follows slime's encoding: for response token r of sample i with r + 1 < len(offsets)
the kept set is ids[offsets[r]:offsets[r + 1]] (an empty range keeps only the target, which the
kernel restores); rows the offsets do not reach stay unmasked.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

Kernel = Callable[..., tuple[torch.Tensor, Optional[torch.Tensor]]]


def _tp_group():
    # Only look at parallel_state if someone imported it: importing megatron is slow and an
    # un-imported module cannot have been initialised.
    mpu = sys.modules.get("megatron.core.parallel_state")
    if mpu is None or not mpu.model_parallel_is_initialized():
        return None
    return mpu.get_tensor_model_parallel_group()


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _as_long(v: Any, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(v, device=device).reshape(-1).to(torch.long)


def _targets(unconcat_tokens: Sequence[Any], total_lengths: Sequence[int], device) -> torch.Tensor:
    """Row j of a sample predicts its token j + 1; the last row's target is never read, any id does."""
    parts = []
    for toks, length in zip(unconcat_tokens, total_lengths, strict=True):
        toks = _as_long(toks, device)
        if toks.numel() != int(length):
            raise ValueError(f"sample has {toks.numel()} tokens, total_length says {int(length)}")
        parts.append(torch.roll(toks, -1))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)


def _first_response_rows(total_lengths: Sequence[int], response_lengths: Sequence[int]) -> list[int]:
    firsts, offset = [], 0
    for length, resp in zip(total_lengths, response_lengths, strict=True):
        if int(resp) > 0 and int(resp) >= int(length):
            raise ValueError("response_length must be smaller than total_length")
        firsts.append(offset + int(length) - int(resp) - 1)
        offset += int(length)
    return firsts


def _keep_mask(shape: tuple[int, int], start: int, firsts: list[int], response_lengths: Sequence[int],
               ids_per_sample, offsets_per_sample, device) -> Optional[torch.Tensor]:
    """Local [T, V_local] keep mask, or None when no row has a recorded nucleus."""
    if ids_per_sample is None or offsets_per_sample is None:
        return None
    v_local = shape[1]
    mask: Optional[torch.Tensor] = None
    for first, resp, ids, offs in zip(firsts, response_lengths, ids_per_sample, offsets_per_sample, strict=True):
        if ids is None or offs is None:
            continue  # not slime's encoding; read as "no nucleus recorded" rather than crash
        offs = _as_long(offs, device)
        n = min(int(resp), offs.numel() - 1)  # rows whose nucleus the offsets record
        if n <= 0:
            continue
        if mask is None:
            mask = torch.ones(shape, dtype=torch.bool, device=device)
        rows = first + torch.arange(n, device=device)
        mask[rows] = False
        ids = _as_long(ids, device)
        counts = offs[1:n + 1] - offs[:n]
        seg = ids[int(offs[0]):int(offs[n])]
        row_of = torch.repeat_interleave(rows, counts)
        local = seg - start
        own = (local >= 0) & (local < v_local)
        mask[row_of[own], local[own]] = True
    return mask


def _cp():
    """(CP size, CP rank, CP group) from parallel_state, or (1, 0, None)."""
    mpu = sys.modules.get("megatron.core.parallel_state")
    if mpu is None or not mpu.model_parallel_is_initialized():
        return 1, 0, None
    return mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank(), mpu.get_context_parallel_group()


def _zigzag_rows(total_lengths: Sequence[int], size: int, rank: int, device) -> torch.Tensor:
    """Packed rows of the rank's two zigzag chunks of every sample, in local order; -1 past a sample's end."""
    parts, base = [], 0
    for length in total_lengths:
        length = int(length)
        chunk = -(-length // (2 * size))
        for c in (rank, 2 * size - 1 - rank):
            j = c * chunk + torch.arange(chunk, device=device)
            parts.append(torch.where(j < length, base + j, torch.full_like(j, -1)))
        base += length
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)


class _CPSum(torch.autograd.Function):
    """Sum over the CP group; its gradient is the sum over the group too."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def _cp_call(kernel: Kernel, x: torch.Tensor, args, unconcat_tokens, total_lengths, response_lengths,
             with_entropy: bool, top_p_token_ids, top_p_token_offsets, cp) -> dict:
    """Context parallelism: this rank's rows are packed rows `rows` (zigzag: its two chunks of every
    sample; all-gather: a contiguous piece). Values go back to packed positions; at all-gather CP the
    packed vector is summed over the CP group, then each rank returns its zigzag chunks' response rows."""
    size, cp_rank, cp_group = cp
    allgather = bool(getattr(args, "allgather_cp", False))
    total = sum(int(n) for n in total_lengths)
    n_local = x.shape[0]
    zigzag = _zigzag_rows(total_lengths, size, cp_rank, x.device)
    if allgather:
        rows = cp_rank * n_local + torch.arange(n_local, device=x.device)
        rows = torch.where(rows < total, rows, torch.full_like(rows, -1))
    else:
        rows = zigzag
    real = rows >= 0
    targets = torch.zeros(n_local, dtype=torch.long, device=x.device)
    targets[real] = _targets(unconcat_tokens, total_lengths, x.device)[rows[real]]
    group = _tp_group()
    firsts = _first_response_rows(total_lengths, response_lengths)
    keep = _keep_mask((total, x.shape[1]), _rank(group) * x.shape[1], firsts, response_lengths,
                      top_p_token_ids, top_p_token_offsets, x.device)
    if keep is not None:
        local_keep = torch.ones(x.shape, dtype=torch.bool, device=x.device)
        local_keep[real] = keep[rows[real]]
        keep = local_keep
    coef = getattr(args, "entropy_coef", None) or 0.0
    chunk = getattr(args, "log_probs_chunk_size", None)
    log_prob, entropy = kernel(x, targets, group, with_entropy=with_entropy,
                               chunk_size=-1 if chunk is None else int(chunk), log_prob_keep_mask=keep,
                               with_entropy_grad=bool(with_entropy and coef != 0))
    outs = {"log_probs": log_prob.reshape(-1)}
    if with_entropy:
        outs["entropy"] = entropy.reshape(-1)
    res = {}
    for key, local in outs.items():
        if allgather:
            packed = local.new_zeros(total).index_put((rows[real],), local[real])
            packed, mine = _CPSum.apply(packed, cp_group), zigzag
        else:
            packed, mine = local, torch.arange(n_local, device=x.device)  # local rows are the zigzag rows
        res[key] = []
        for a, r in zip(firsts, response_lengths, strict=True):
            wanted = (zigzag >= a) & (zigzag < a + int(r))
            res[key].append(packed[mine[wanted]])
    return res


def make_wrapper(kernel: Kernel) -> Callable[..., tuple[torch.Tensor, dict]]:
    def get_log_probs_and_entropy(logits: torch.Tensor, *, args, unconcat_tokens, total_lengths,
                                  response_lengths, with_entropy: bool = False, non_loss_data: bool = True,
                                  top_p_token_ids=None, top_p_token_offsets=None):
        if logits.dim() != 3 or logits.shape[0] != 1:
            raise ValueError(f"logits must be [1, T, V_local], got {tuple(logits.shape)}")
        x = logits.squeeze(0)  # a view whose backward is a view: indexing would allocate [1, T, V_local]
        temperature = getattr(args, "rollout_temperature", None)
        if temperature is not None and float(temperature) != 1.0:
            x = x / float(temperature)  # never in place: the caller's logits stay intact
        cp = _cp()
        if cp[0] > 1:
            res = _cp_call(kernel, x, args, unconcat_tokens, total_lengths, response_lengths, with_entropy,
                           top_p_token_ids, top_p_token_offsets, cp)
            return torch.empty(0, device=logits.device), res
        coef = getattr(args, "entropy_coef", None) or 0.0
        chunk = getattr(args, "log_probs_chunk_size", None)
        group = _tp_group()
        firsts = _first_response_rows(total_lengths, response_lengths)
        keep = _keep_mask(tuple(x.shape), _rank(group) * x.shape[1], firsts, response_lengths,
                          top_p_token_ids, top_p_token_offsets, x.device)
        log_prob, entropy = kernel(x, _targets(unconcat_tokens, total_lengths, x.device), group,
                                   with_entropy=with_entropy, chunk_size=-1 if chunk is None else int(chunk),
                                   log_prob_keep_mask=keep, with_entropy_grad=bool(with_entropy and coef != 0))
        log_prob = log_prob.reshape(-1)
        res: dict[str, list[torch.Tensor]] = {"log_probs": [log_prob[a:a + int(r)] for a, r in
                                                            zip(firsts, response_lengths, strict=True)]}
        if with_entropy:
            res["entropy"] = [entropy[a:a + int(r)] for a, r in zip(firsts, response_lengths, strict=True)]
        return torch.empty(0, device=logits.device), res

    return get_log_probs_and_entropy
