"""Job functions the engine tests send to the worker pools (importable by forked ranks)."""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def whoami(ctx) -> tuple[int, int]:
    return ctx.rank, os.getpid()


def hang_on(ctx, rank: int) -> int:
    if ctx.rank == rank:
        time.sleep(3600)
    return ctx.rank


def die_on(ctx, rank: int) -> int:
    if ctx.rank == rank:
        os._exit(3)
    return ctx.rank


def raise_on(ctx, rank: int) -> int:
    if ctx.rank == rank:
        raise ValueError("boom")
    return ctx.rank


def all_reduce_sum(ctx) -> float:
    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t)
    return t.item()


def memory_figures(ctx, case, target_spec: str) -> dict:
    """This rank's scalar memory figures for one case (as a baseline records them)."""
    from harness.engine.executor import run_on_rank
    from harness.meters.memory import figures_of
    from harness.targets import load_target

    result = run_on_rank(case, load_target(target_spec), ctx.rank, ctx.device)
    return {"error": result.error} if result.error else figures_of(result.obs.memory)
