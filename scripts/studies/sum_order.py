"""Why a routine that all-reduces per-row statistics is not bitwise batch-invariant at TP > 2
(docs/bitwise.md): gloo's all-reduce adds the ranks' values in an order that depends on the
buffer's length. Also PyTorch's CPU row sums: on several threads and long rows, and over a
strided (transposed) last dimension.

    python scripts/studies/sum_order.py
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _allreduce(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = torch.rand(32, generator=torch.Generator().manual_seed(rank))
    whole = x.clone()
    dist.all_reduce(whole)
    differ = []
    for n in range(1, 33):
        prefix = x[:n].clone()
        dist.all_reduce(prefix)
        differ.append(int((prefix.view(torch.int32) != whole[:n].view(torch.int32)).sum()))
    if rank == 0:
        print(f"gloo world size {world}: elements of a length-n all-reduce that differ in their bits from the "
              f"same elements of a length-32 one, n = 1..32: {differ}")
    dist.destroy_process_group()


def _row_sums() -> None:
    torch.manual_seed(0)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for V in (1000, 40000):
            x = torch.rand(8, V)
            batch = x.sum(-1)
            alone = torch.stack([x[i:i + 1].sum(-1)[0] for i in range(8)])
            n = int((batch.view(torch.int32) != alone.view(torch.int32)).sum())
            print(f"torch CPU sum, {threads} thread(s), 8 rows of {V}: {n} of 8 rows differ alone vs in the batch")


def _strided_sums() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for layout in ("contiguous", "transposed"):
        for V in (5, 13, 40):
            differ = 0
            for T in range(2, 25):
                x = torch.rand(T, V) if layout == "contiguous" else torch.rand(V, T).t()
                whole = x.sum(-1)
                for P in range(1, T):
                    part = torch.empty_like(x[:P]) if layout == "contiguous" else torch.empty(V, P).t()
                    part.copy_(x[:P])
                    differ += int((part.sum(-1).view(torch.int32) != whole[:P].view(torch.int32)).sum())
            print(f"torch CPU sum over the last dim, {layout} [T, {V}], T = 2..24: {differ} row sums of a "
                  f"prefix differ from the same rows' sums in the whole tensor")


if __name__ == "__main__":
    for i, world in enumerate((2, 3, 4)):
        mp.spawn(_allreduce, args=(world, 29630 + i), nprocs=world)
    _row_sums()
    _strided_sums()
