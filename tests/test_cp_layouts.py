"""reference/cp.py against slime's CP offsets, written out by hand for small cases
(`get_logits_and_tokens_offset_with_cp`, `slice_log_prob_with_cp`, the all-gather CP chunking)."""
from __future__ import annotations

import pytest

from harness.reference.cp import PAD, local_rows, response_positions


def test_zigzag_rows_of_one_sample():
    # L = 5, c = 2: chunks of ceil(5/4) = 2 rows [0,2) [2,4) [4,6) [6,8); rank 0 holds chunks 0 and 3,
    # rank 1 chunks 1 and 2; rows 5.. are padding.
    assert local_rows([5], 2, "zigzag", 0) == [0, 1, PAD, PAD]
    assert local_rows([5], 2, "zigzag", 1) == [2, 3, 4, PAD]


def test_zigzag_rows_sample_by_sample():
    # Samples of 3 and 4 rows at c = 2: chunk sizes 1 and 1; sample two starts at packed row 3.
    assert local_rows([3, 4], 2, "zigzag", 0) == [0, PAD, 3, 6]
    assert local_rows([3, 4], 2, "zigzag", 1) == [1, 2, 4, 5]


def test_zigzag_rows_cp4_short_sample():
    # L = 3 < 2c = 8: chunks of 1 row; rank r holds rows r and 7 - r.
    assert [local_rows([3], 4, "zigzag", r) for r in range(4)] == [[0, PAD], [1, PAD], [2, PAD], [PAD, PAD]]


def test_allgather_rows():
    # 7 packed rows at c = 2: 4 rows per rank, the last one padded.
    assert local_rows([3, 4], 2, "allgather", 0) == [0, 1, 2, 3]
    assert local_rows([3, 4], 2, "allgather", 1) == [4, 5, 6, PAD]
    assert local_rows([1], 4, "allgather", 3) == [PAD]


@pytest.mark.parametrize("L,R,cp,expected", [
    # L = 5, R = 3 (prompt 2), c = 2, chunk 2: slime's logits offsets for rank 0 are (1, 2) and an empty
    # second chunk, so rank 0 returns response position 0; rank 1 holds (2, 4) and (4, 4): positions 1, 2.
    (5, 3, 2, [[0], [1, 2]]),
    # L = 8, R = 6 (prompt 2), c = 2, chunk 2: rank 0: (1, 2) and (6, 7); rank 1: (2, 4) and (4, 6).
    (8, 6, 2, [[0, 5], [1, 2, 3, 4]]),
    # Prompt of length 1: the response rows start at row 0.
    (4, 3, 2, [[0], [1, 2]]),
    # No response: every rank returns nothing.
    (6, 0, 2, [[], []]),
    # A response wholly on one rank's chunks: L = 8, R = 1 (row 6, chunk 3, held by rank 0).
    (8, 1, 2, [[0], []]),
    # c = 4, L = 8, R = 7, chunk 1: rank r holds rows r and 7 - r; row 7 predicts nothing.
    (8, 7, 4, [[0], [1, 6], [2, 5], [3, 4]]),
])
def test_response_positions(L, R, cp, expected):
    got = [response_positions(L, R, cp, r) for r in range(cp)]
    assert got == expected
    assert sorted(p for ps in got for p in ps) == list(range(R))  # the pieces partition the response
