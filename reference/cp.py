"""Context-parallel layouts of a packed batch (docs/contract.md, "Context parallelism"): pure index math.

With CP size c > 1 a rank holds some rows of the packed sequence, not all of them:
- **zigzag** (ring attention): each sample of length L is cut into 2c chunks of ceil(L / 2c) rows
  (the last padded); CP rank r holds chunks r and 2c-1-r of every sample, sample by sample;
- **allgather**: the packed sequence (sum of the lengths) is cut into c contiguous pieces of
  ceil(sum / c) rows (the last padded); rank r holds piece r.

Under both layouts the wrapper returns, per sample, the response values of its zigzag chunks:
the response rows chunk r holds, then those chunk 2c-1-r holds (all-gather CP re-slices to that).
Everything here is a function of the lengths, the CP size and the rank, so the oracle (main process)
and the executor (each rank) derive the same rows.

Named for what it computes, as `targets/mutants/cp.py` breaks it: one module name across the layers.
"""
from __future__ import annotations

LAYOUTS = ("zigzag", "allgather")
PAD = -1  # the global row of a padding row


def zigzag_chunk(total_length: int, cp: int) -> int:
    """Rows per zigzag chunk of a sample: ceil(L / 2c)."""
    return -(-int(total_length) // (2 * cp))


def allgather_rows(total_lengths: list[int], cp: int) -> int:
    """Rows per rank under all-gather CP: ceil(sum(L) / c)."""
    return -(-sum(int(n) for n in total_lengths) // cp)


def _chunks(rank: int, cp: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def local_rows(total_lengths: list[int], cp: int, layout: str, rank: int) -> list[int]:
    """The packed global row each local row of CP rank `rank` holds, in local order; PAD for padding."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown CP layout {layout!r}; expected one of {LAYOUTS}")
    if not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} outside a CP group of {cp}")
    if cp == 1:
        return list(range(sum(int(n) for n in total_lengths)))
    if layout == "allgather":
        total, n = sum(int(x) for x in total_lengths), allgather_rows(total_lengths, cp)
        return [g if g < total else PAD for g in range(rank * n, (rank + 1) * n)]
    rows: list[int] = []
    offset = 0
    for length in total_lengths:
        length = int(length)
        size = zigzag_chunk(length, cp)
        for chunk in _chunks(rank, cp):
            rows += [offset + j if j < length else PAD for j in range(chunk * size, (chunk + 1) * size)]
        offset += length
    return rows


def response_positions(total_length: int, response_length: int, cp: int, rank: int) -> list[int]:
    """Which response positions (0..R-1) of one sample CP rank `rank` returns, in order: those its
    zigzag chunk r predicts, then those of chunk 2c-1-r. Response position k is predicted by the
    sample's row P-1+k (P = L - R, the prompt length); the sample's last row predicts nothing."""
    L, R = int(total_length), int(response_length)
    if cp == 1:
        return list(range(R))
    first, end = L - R - 1, L - 1  # the rows predicting the response: [P-1, L-1)
    size = zigzag_chunk(L, cp)
    out: list[int] = []
    for chunk in _chunks(rank, cp):
        lo, hi = max(chunk * size, first), min((chunk + 1) * size, end)
        out += [row - first for row in range(lo, hi)]
    return out
