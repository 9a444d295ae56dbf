"""Persistent tensor-parallel worker pools: one per TP size, started once, reused for every case.

Each rank joins a real `torch.distributed` group (gloo on CPU, NCCL on CUDA) with a collective
timeout, and initialises megatron-core's `parallel_state` with TP = the pool size, so wrappers find
their group where production code looks. The main process sends each job to every rank and waits
with a deadline; a rank that dies or does not answer becomes an error result naming it, and the
pool is torn down and rebuilt. Workers die with the main process (PR_SET_PDEATHSIG) and are
terminated at exit, so no process outlives the run.
"""
from __future__ import annotations

import atexit
import ctypes
import importlib
import os
import shutil
import signal
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp

from harness.errors import PoolStartError
from harness.observations import RankResult

DEFAULT_COLLECTIVE_TIMEOUT_S = 20.0
STARTUP_TIMEOUT_S = 120.0
RAISED_GRACE_S = 2.0


@dataclass(frozen=True)
class RankContext:
    rank: int
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


def _worker_main(rank: int, world: int, store_dir: str, conn: Connection, backend: str,
                 timeout_s: float, parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process owns shutdown
    torch.set_num_threads(1)
    import torch.distributed as dist

    from harness.meters import trace

    trace.install()  # before any target import, so early-bound names are traced too
    device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend, init_method=f"file://{store_dir}/store", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        from megatron.core import parallel_state

        # megatron-core gives its groups their own timeout (30 minutes by default): pass ours on,
        # or a collective on the TP group could outwait every deadline.
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world,
                                                 distributed_timeout_minutes=timeout_s / 60.0,
                                                 create_gloo_process_groups=False)
    except Exception:
        conn.send(("failed", traceback.format_exc(limit=4)))
        return
    ctx = RankContext(rank, world, device)
    conn.send(("ready", rank))
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
        conn.send(reply)
    try:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    except Exception:
        pass


class WorkerPool:
    def __init__(self, tp: int, device: str = "cpu", collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S):
        self.tp = tp
        self.backend = "nccl" if device == "cuda" else "gloo"
        self.start_method = "spawn" if device == "cuda" else "fork"
        self.collective_timeout_s = collective_timeout_s
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.store_dir: str | None = None
        self.restarts = 0
        self.start()

    def start(self) -> None:
        if self.start_method == "fork":
            # Imported once here, inherited by every fork: a rebuilt pool starts in a fraction of
            # a second instead of re-importing megatron-core in each rank.
            with warnings.catch_warnings():  # optional-dependency notices, not ours to show
                warnings.simplefilter("ignore")
                import megatron.core.parallel_state  # noqa: F401
        ctx = mp.get_context(self.start_method)
        self.store_dir = tempfile.mkdtemp(prefix=f"harness-tp{self.tp}-")
        for rank in range(self.tp):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, name=f"harness-tp{self.tp}-rank{rank}", daemon=True,
                            args=(rank, self.tp, self.store_dir, child, self.backend,
                                  self.collective_timeout_s, os.getpid()))
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        _LIVE.add(self)
        replies = self._gather(time.monotonic() + STARTUP_TIMEOUT_S)
        bad = [f"rank {r}: {m.error}" for r, m in enumerate(replies) if isinstance(m, RankResult) and m.error]
        bad += [f"rank {r}: {m[1]}" for r, m in enumerate(replies) if isinstance(m, tuple) and m[0] != "ready"]
        if bad:
            self.close()
            raise PoolStartError(f"TP {self.tp} pool failed to start: " + "; ".join(bad))

    def _gather(self, deadline: float) -> list[Any]:
        """One reply per rank, or a RankResult naming why that rank gave none. Once a rank has
        raised, the others get RAISED_GRACE_S more: a rank left waiting in a collective its peer
        never issued would otherwise hold the case until the collective timeout."""
        replies: dict[int, Any] = {}
        raised_at: float | None = None
        pending = {c: r for r, c in enumerate(self.conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready = wait([*pending, *(s for s, r in sentinels.items() if r not in replies)], timeout=left)
            for obj in ready:
                if obj in pending:
                    r = pending.pop(obj)
                    try:
                        replies[r] = obj.recv()
                    except (EOFError, OSError):
                        pass
                    if raised_at is None and isinstance(replies.get(r), RankResult) and replies[r].error:
                        raised_at = time.monotonic()
                        deadline = min(deadline, raised_at + RAISED_GRACE_S)
                elif sentinels.get(obj) is not None and sentinels[obj] not in replies:
                    r = sentinels[obj]
                    conn = self.conns[r]
                    if conn in pending and conn.poll():
                        continue  # it answered before exiting: read the answer first
                    pending.pop(conn, None)
                    sentinels.pop(obj)
                    self.procs[r].join(1.0)  # reap it, so the exit code is known
                    code = self.procs[r].exitcode
                    replies[r] = RankResult(r, error=f"rank {r} died (exit code {code})", error_kind="died")
        for r in range(self.tp):
            if r not in replies:
                why = (f"still running {RAISED_GRACE_S:.0f}s after another rank raised (blocked in a collective?)"
                       if raised_at is not None else "gave no answer within the deadline (hung)")
                replies[r] = RankResult(r, error=f"rank {r} {why}", error_kind="timeout")
        return [replies[r] for r in range(self.tp)]

    def call(self, fn_path: str, args_per_rank: list[tuple], deadline_s: float) -> list[Any]:
        """Run `fn_path(ctx, *args)` on every rank; rebuild the pool if any rank failed to answer."""
        if _interrupted:
            raise KeyboardInterrupt  # the first one was swallowed (e.g. raised inside a finalizer)
        for conn, args in zip(self.conns, args_per_rank):
            try:
                conn.send((fn_path, args))
            except (BrokenPipeError, OSError):
                pass  # the rank is gone; _gather reports it
        replies = self._gather(time.monotonic() + deadline_s)
        if any(isinstance(r, RankResult) and r.error_kind in ("timeout", "died") for r in replies):
            self.restart()
        return replies

    def run(self, fn_path: str, *args: Any, deadline_s: float | None = None) -> list[Any]:
        deadline = deadline_s if deadline_s is not None else self.collective_timeout_s * 2 + 10
        return self.call(fn_path, [args] * self.tp, deadline)

    def restart(self) -> None:
        self.close()
        self.restarts += 1
        self.start()

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 2.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        if self.store_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)
            self.store_dir = None
        _LIVE.discard(self)


_LIVE: set[WorkerPool] = set()


@atexit.register
def close_all() -> None:
    for pool in list(_LIVE):
        pool.close()


_interrupted = False


def on_sigint(signum: int, frame: Any) -> None:
    """Ctrl-C: raise KeyboardInterrupt now, and again at the next job should this one be swallowed."""
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through atexit, which closes the pools


if hasattr(signal, "SIGTERM") and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
    signal.signal(signal.SIGTERM, _on_sigterm)
