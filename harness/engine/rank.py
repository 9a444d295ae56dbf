"""The rank loop: what a worker process of a pool runs, from joining its process group to its last job.

Each rank joins a real `torch.distributed` group (gloo on CPU, NCCL on CUDA) with a collective
timeout, and initialises megatron-core's `parallel_state` with the pool's TP and CP sizes, so wrappers
find their groups where production code looks. It then runs each job the driver sends (a function
named by its import path, `resolve`) and replies by value (`wire`). A worker dies with the main
process (PR_SET_PDEATHSIG). The driver's side of the pool is `harness.driver.pool`.
"""
from __future__ import annotations

import ctypes
import importlib
import os
import signal
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch

from harness.engine import stacks, wire
from harness.engine.observations import RankResult
from harness.engine.progress import ProgressBoard


@dataclass(frozen=True)
class RankContext:
    rank: int  # the rank in the pool's world
    world: int
    device: torch.device


def _die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def resolve(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _reply(conn: Connection, obj: Any) -> None:
    """Send a reply to the driver by value (`wire`)."""
    conn.send_bytes(wire.dumps(obj))


def coordinates(rank: int, tp: int, cp: int) -> tuple[int, int, int]:
    """(TP rank, CP rank, DP replica) of world rank `rank` in megatron-core's default order."""
    return rank % tp, (rank // tp) % cp, rank // (tp * cp)


def _worker_main(rank: int, world: int, store_dir: str, conn: Connection, backend: str,
                 timeout_s: float, parent_pid: int, tp: int, board: ProgressBoard, cp: int = 1) -> None:
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process owns shutdown
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the driver's handler, inherited by fork
    torch.set_num_threads(1)
    import torch.distributed as dist

    from harness.meters import trace

    trace.install()  # before any target import, so early-bound names are traced too
    board.attach(rank)
    stack_fh = stacks.install(store_dir, rank)  # noqa: F841 (kept open: faulthandler writes to it)
    device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend, init_method=f"file://{store_dir}/store", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        from megatron.core import parallel_state

        # megatron-core gives its groups their own timeout (30 minutes by default): pass ours on,
        # or a collective on the TP group could outwait every deadline. (It annotates the minutes as
        # an int, but takes timedelta(minutes=...) of them: a fraction is kept.)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, context_parallel_size=cp,
            distributed_timeout_minutes=timeout_s / 60.0,  # pyright: ignore[reportArgumentType]
            create_gloo_process_groups=False)
        coords = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_context_parallel_rank(),
                  parallel_state.get_data_parallel_rank())
        if coords != coordinates(rank, tp, cp):  # the layout the driver assumes to name ranks
            raise RuntimeError(f"rank {rank}: megatron-core placed it at (TP rank, CP rank, DP rank) {coords}, "
                               f"expected {coordinates(rank, tp, cp)}")
    except Exception:
        _reply(conn, ("failed", traceback.format_exc(limit=4)))
        return
    ctx = RankContext(rank, world, device)
    _reply(conn, ("ready", rank))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        fn_path, args = msg
        try:
            reply = resolve(fn_path)(ctx, *args)
        except Exception as e:  # a job function failing is reported, never fatal to the worker
            reply = RankResult.from_exception(rank, e)
        _reply(conn, reply)
    try:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    except Exception:
        pass
