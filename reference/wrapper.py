"""Float64 oracle for the level-2 loss-side wrapper `get_log_probs_and_entropy` (docs/contract.md).

Works on the full, unsharded `[T, V]` logits of a packed batch (no batch dim). The chunk size in
`args` is a memory knob only, so it does not appear here.

Named for its level, as `checks/wrapper.py` checks it and `targets/mutants/wrapper.py` breaks it:
a level keeps one module name across the layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import kernel

__all__ = [
    "entropy_grad_rule",
    "apply_temperature",
    "shifted_targets",
    "response_rows",
    "recorded_rows",
    "top_p_keep_mask",
    "wrapper_outputs",
    "wrapper_logits_grad",
]


def entropy_grad_rule(with_entropy: bool, args: Any) -> bool:
    """slime PR #2153: the entropy is differentiable iff requested and its coefficient is non-zero."""
    # `!= 0` makes -0.0 zero and keeps negative coefficients (still a coefficient).
    return bool(with_entropy and getattr(args, "entropy_coef", 0.0) != 0)


def _temperature(args: Any) -> float:
    t = getattr(args, "rollout_temperature", None)
    return 1.0 if t is None else float(t)


def apply_temperature(logits: Tensor, temperature: float | None) -> Tensor:
    """float64 logits divided by the temperature (None means 1.0)."""
    return logits.to(torch.float64) / (1.0 if temperature is None else float(temperature))


def _offsets(total_lengths: list[int]) -> list[int]:
    out, o = [], 0
    for length in total_lengths:
        out.append(o)
        o += int(length)
    return out


def shifted_targets(unconcat_tokens: list[Tensor], total_lengths: list[int]) -> Tensor:
    """`[T]` int64: row o+j of sample i predicts x_{j+1}; a sample's last row gets 0."""
    if len(unconcat_tokens) != len(total_lengths):
        raise ValueError("unconcat_tokens and total_lengths differ in length")
    parts = []
    for toks, length in zip(unconcat_tokens, total_lengths, strict=True):
        toks = toks.reshape(-1).to(torch.int64)
        if toks.numel() != int(length):
            raise ValueError(f"sample has {toks.numel()} tokens, total_length says {length}")
        if length > 0:
            # The last row has no successor; 0 is a placeholder that no response row uses.
            parts.append(torch.cat([toks[1:], toks.new_zeros(1)]))
    if not parts:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat(parts)


def response_rows(total_lengths: list[int], response_lengths: list[int]) -> list[Tensor]:
    """Per sample the int64 packed rows `o+L-R-1 .. o+L-2` that predict its response tokens."""
    if len(total_lengths) != len(response_lengths):
        raise ValueError("total_lengths and response_lengths differ in length")
    rows = []
    for o, length, r in zip(_offsets(total_lengths), total_lengths, response_lengths, strict=True):
        length, r = int(length), int(r)
        # The first response token is predicted by the row before it, so a prompt of >= 1 token
        # is needed; otherwise the row would fall into the previous sample.
        if r < 0 or (r > 0 and r > length - 1):
            raise ValueError(f"response_length {r} does not fit in total_length {length}")
        rows.append(torch.arange(o + length - r - 1, o + length - 1, dtype=torch.int64))
    return rows


def _as_list(x: Any) -> list[int]:
    return [int(v) for v in (x.reshape(-1).tolist() if isinstance(x, Tensor) else x)]


def recorded_rows(offsets: list[int], response_length: int) -> int:
    """How many leading response rows have a recorded nucleus: row r has one iff r + 1 < len(offsets)."""
    return max(0, min(int(response_length), len(offsets) - 1))


def top_p_keep_mask(
    T: int,
    V: int,
    total_lengths: list[int],
    response_lengths: list[int],
    top_p_token_ids: list[Any] | None,
    top_p_token_offsets: list[Any] | None,
) -> Tensor | None:
    """`[T, V]` bool log-prob keep mask replayed from the rollout nucleus (slime's encoding); None
    when no replay data is given.

    Per sample, `ids` and `offsets` (tensors or lists of ints, never None). Response row r with
    `r + 1 < len(offsets)` keeps exactly `ids[offsets[r]:offsets[r+1]]`: an empty range keeps
    nothing, so only the target survives (the kernel restores it) and the log-prob is 0. Rows the
    offsets do not reach have no recorded nucleus and stay unmasked.
    """
    if top_p_token_ids is None or top_p_token_offsets is None:
        return None
    if len(top_p_token_ids) != len(total_lengths) or len(top_p_token_offsets) != len(total_lengths):
        raise ValueError("top-p replay needs one ids and one offsets entry per sample")
    mask = torch.ones(T, V, dtype=torch.bool)
    for rows, ids, offsets in zip(response_rows(total_lengths, response_lengths), top_p_token_ids,
                                  top_p_token_offsets, strict=True):
        if ids is None or offsets is None:
            raise ValueError("a sample's top-p ids or offsets are None: not part of the interface "
                             "(a sample without a recorded nucleus has a short offsets list)")
        ids, offsets = _as_list(ids), _as_list(offsets)
        for r in range(recorded_rows(offsets, rows.numel())):
            row = int(rows[r])
            mask[row] = False
            kept = ids[offsets[r]:offsets[r + 1]]
            if kept:
                mask[row, torch.tensor(kept, dtype=torch.int64)] = True
    return mask


def _check_logits(logits: Tensor, total_lengths: list[int]) -> None:
    if logits.dim() != 2 or logits.shape[0] != sum(int(n) for n in total_lengths):
        raise ValueError(f"logits must be [sum(total_lengths), V], got {tuple(logits.shape)}")


def _prepare(
    logits: Tensor,
    unconcat_tokens: list[Tensor],
    total_lengths: list[int],
    response_lengths: list[int],
    top_p_token_ids: list[Any] | None,
    top_p_token_offsets: list[Any] | None,
) -> tuple[Tensor, list[Tensor], Tensor | None]:
    # Shifted targets, response rows and the top-p keep mask, all on the logits' device.
    _check_logits(logits, total_lengths)
    T, V = logits.shape
    tokens = shifted_targets(unconcat_tokens, total_lengths).to(logits.device)
    rows = [r.to(logits.device) for r in response_rows(total_lengths, response_lengths)]
    mask = top_p_keep_mask(T, V, total_lengths, response_lengths, top_p_token_ids, top_p_token_offsets)
    if mask is not None:
        mask = mask.to(logits.device)
    return tokens, rows, mask


def wrapper_outputs(
    logits: Tensor,
    args: Any,
    unconcat_tokens: list[Tensor],
    total_lengths: list[int],
    response_lengths: list[int],
    with_entropy: bool,
    top_p_token_ids: list[Any] | None = None,
    top_p_token_offsets: list[Any] | None = None,
) -> dict:
    """Per-sample response log-probs and entropies (float64) and whether the entropy has a grad."""
    tokens, rows, mask = _prepare(
        logits, unconcat_tokens, total_lengths, response_lengths, top_p_token_ids, top_p_token_offsets
    )
    x = apply_temperature(logits, _temperature(args))
    lp = kernel.log_probs(x, tokens, mask)
    ent = kernel.entropy(x) if with_entropy else None
    return {
        "log_probs": [lp[r] for r in rows],
        "entropy": None if ent is None else [ent[r] for r in rows],
        "entropy_requires_grad": entropy_grad_rule(with_entropy, args),
    }


def _scatter_rows(per_sample: list[Tensor], rows: list[Tensor], T: int, device: torch.device) -> Tensor:
    # Rows outside every response get weight 0; response rows never overlap across samples.
    w = torch.zeros(T, dtype=torch.float64, device=device)
    for values, r in zip(per_sample, rows, strict=True):
        w[r] = values.reshape(-1).to(device=device, dtype=torch.float64)
    return w


def wrapper_logits_grad(
    logits: Tensor,
    args: Any,
    unconcat_tokens: list[Tensor],
    total_lengths: list[int],
    response_lengths: list[int],
    with_entropy: bool,
    w_log_probs: list[Tensor],
    w_entropy: list[Tensor] | None,
    top_p_token_ids: list[Any] | None = None,
    top_p_token_offsets: list[Any] | None = None,
) -> Tensor:
    """`[T, V]` float64 gradient w.r.t. the raw logits of the weighted response log-probs/entropies.

    The entropy term counts only under `entropy_grad_rule`: metric-only entropy has no gradient.
    """
    tokens, rows, mask = _prepare(
        logits, unconcat_tokens, total_lengths, response_lengths, top_p_token_ids, top_p_token_offsets
    )
    T = logits.shape[0]
    tau = _temperature(args)
    w1 = _scatter_rows(w_log_probs, rows, T, logits.device)
    w2 = None
    if w_entropy is not None and entropy_grad_rule(with_entropy, args):
        w2 = _scatter_rows(w_entropy, rows, T, logits.device)
    g = kernel.logits_grad(apply_temperature(logits, tau), tokens, mask, w1, w2)
    # Chain rule through x = z / tau.
    return g / tau
