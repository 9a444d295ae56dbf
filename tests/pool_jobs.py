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


def die_while_others_run(ctx, rank: int) -> int:
    """`rank` dies while the other ranks are still working (they return a moment later)."""
    if ctx.rank == rank:
        time.sleep(0.2)
        os._exit(3)
    time.sleep(1.5)
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
    from harness.meters.memory_meter import figures_of
    from harness.targets import load_target

    result = run_on_rank(case, load_target(target_spec), ctx.rank, ctx.device)
    return {"error": result.error} if result.error else figures_of(result.obs.memory)


def busy_on_one_line(ctx, seconds: float) -> int:
    """Works for `seconds` without its stack changing (as one long C call, or a timing loop, does)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end: pass  # noqa: E701 (one line on purpose: one unchanging stack)
    return ctx.rank


def sleep_everywhere(ctx) -> int:
    """Every rank hangs outside any collective (a target spinning forever)."""
    time.sleep(3600)
    return ctx.rank


def cross_blocked(ctx) -> int:
    """Every rank blocked, none returned: rank 0 waits in the TP group for rank 1, which waits in
    the world group for rank 0 (two process groups: a real deadlock, not a mismatch gloo reports)."""
    from megatron.core import parallel_state

    t = torch.ones(1)
    if ctx.rank == 0:
        dist.all_reduce(t, group=parallel_state.get_tensor_model_parallel_group())
    else:
        dist.all_reduce(t)
    return ctx.rank


def layout(ctx) -> tuple[int, int, int, int, int]:
    """(world rank, TP rank, DP rank, TP group size, world size), as parallel_state reports them."""
    from megatron.core import parallel_state as mpu

    return (ctx.rank, mpu.get_tensor_model_parallel_rank(), mpu.get_data_parallel_rank(),
            dist.get_world_size(mpu.get_tensor_model_parallel_group()), dist.get_world_size())


def tp_sum(ctx) -> float:
    """An all-reduce over the TP group: each replica sums only its own ranks."""
    from megatron.core import parallel_state as mpu

    t = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(t, group=mpu.get_tensor_model_parallel_group())
    return t.item()


def cp_layout(ctx) -> tuple[int, ...]:
    """(world rank, TP rank, CP rank, DP rank, CP size, CP group size, the CP group's sum of world ranks)."""
    from megatron.core import parallel_state as mpu

    group = mpu.get_context_parallel_group()
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t, group=group)
    return (ctx.rank, mpu.get_tensor_model_parallel_rank(), mpu.get_context_parallel_rank(), mpu.get_data_parallel_rank(),
            mpu.get_context_parallel_world_size(), dist.get_world_size(group), int(t.item()))


def slow_import(ctx, folder: str) -> int:
    """A first call that imports a module taking seconds to import (a peer pulling in its framework)."""
    import sys

    sys.path.insert(0, folder)
    import harness_slow_module  # noqa: F401

    return ctx.rank


def raise_while_another_imports(ctx, folder: str) -> int:
    """Rank 0 raises at once; rank 1 is still importing (as a rank still compiling the same call is)."""
    if ctx.rank == 0:
        raise ValueError("raised before any collective")
    return slow_import(ctx, folder)


def traced_gathers(ctx) -> list:
    """The trace of torch 2.13's `*_single` collectives and of the deprecated names that call them."""
    import warnings

    from harness.meters import trace

    x = torch.full((2,), float(ctx.rank))
    with trace.recording() as events, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_single(torch.empty(4), x)
        dist.all_gather_into_tensor(torch.empty(4), x)
        dist.reduce_scatter_single(torch.empty(1), x)
    return [(op, size, list(shape)) for op, size, shape, _ in events]


def both_ledgers(ctx, case, target_spec: str) -> dict:
    """This rank's memory figures of one case, measured by each ledger in turn (the wrapper's
    kernel-pass figures included): what tests/test_ledger_parity.py compares."""
    from harness.engine.executor import case_job
    from harness.meters import memory_meter

    out = {}
    for name, ledger in (("mode", memory_meter.ModeLedger), ("compiled", memory_meter.compiled_ledger())):
        original = memory_meter.ledger_class
        memory_meter.ledger_class = lambda ledger=ledger: ledger
        try:
            result = case_job(ctx, case, target_spec)
        finally:
            memory_meter.ledger_class = original
        passes = result.obs.kernel_pass.memory if result.obs.kernel_pass is not None else {}
        out[name] = {"error": result.error, "memory": result.obs.memory, "kernel_pass": passes}
    return out


def collective_behind_the_ledgers_back(ctx) -> tuple[dict, str, str]:
    """A counted storage handed to a ProcessGroup directly, not through torch.distributed's
    functions: the figures of that call, and the ledger this process uses after it (then reset)."""
    from harness.meters import memory_meter

    meter = memory_meter.Meter((), ctx.device, ledger=memory_meter.compiled_ledger())
    with meter.forward():
        t = torch.ones(64)
        dist.distributed_c10d._get_default_group().allreduce([t]).wait()
    after = memory_meter.ledger_class().__name__
    memory_meter._fallen_back = False
    return meter.figures, after, memory_meter.ledger_class().__name__
