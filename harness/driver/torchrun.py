"""Under torchrun, the launched ranks serve the TP cases, in place of the harness's own pools.

`torchrun --nproc_per_node 8 -m harness check --tp 8` (or `... -m pytest --pyargs harness.conformance
--tp 8`) starts the command once per rank; on several nodes, `torchrun --nnodes N --nproc_per_node G
--rdzv-backend c10d --rdzv-endpoint HOST:PORT -m harness check --tp T`. Every rank joins the env://
rendezvous and initialises megatron-core's parallel_state with TP = `--tp`, which must divide the
world size: the world is DP = world / TP replicas of the TP group, as in training (TP groups are
contiguous ranks, so TP = GPUs per node keeps each group within a node). Every replica runs each
case, on its own data (`Case.replica`); the checks evaluate replica 0 against the oracle, so a
routine that reduces over the wrong group gives a wrong answer. Then:

- rank 0 is the driver: it runs the command as usual (draws cases, evaluates the checks against
  the oracle, prints the report). Its runner gets the `LaunchedPool`, whose `run` sends each job to
  the other ranks, runs it on rank 0 too, and gathers every rank's result;
- the other ranks serve: they run jobs until rank 0 sends "stop" with its exit code, and exit with it.

Jobs and results travel on a gloo group of their own, never on a group the target reduces over, so
a target that leaves collectives unmatched cannot corrupt the control channel; after such a case
every rank rebuilds its TP groups (`restart`). The TP groups time out after the collective timeout,
so a rank stuck in a collective comes back as an error result. A rank that dies, or hangs outside a
collective, ends the run: here the launcher, not the harness, owns the processes.
"""
from __future__ import annotations

import functools
import os
from argparse import Namespace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from harness.base.errors import LaunchError
from harness.driver.pool import WorkerPool
from harness.engine.observations import RankResult
from harness.engine.rank import RankContext, resolve
from harness.meters import trace

if TYPE_CHECKING:
    from harness.base.options import RunConfig

LAUNCH_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK")
# Serving ranks wait on the control group while the driver evaluates, shrinks and reports.
CONTROL_TIMEOUT = timedelta(days=1)


def active() -> bool:
    """Started by torchrun (or any launcher setting the env:// variables)."""
    return all(k in os.environ for k in LAUNCH_ENV)


def rank() -> int:
    return int(os.environ["RANK"])


def world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


def check_sizes(tp_sizes: list[int]) -> int:
    """The one TP size of a launched run: it must divide the world size. Returns it."""
    world = world_size()
    if len(tp_sizes) != 1 or world % tp_sizes[0]:
        asked = ",".join(map(str, tp_sizes))
        divisors = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        raise LaunchError(f"torchrun launched {world} ranks: pass one TP size that divides it "
                          f"(--tp {world} for one TP group; one of {divisors}) (got --tp {asked})")
    return tp_sizes[0]


def _call(ctx: RankContext, fn_path: str, args: tuple) -> Any:
    try:
        return resolve(fn_path)(ctx, *args)
    except Exception as e:  # a job failing is its result, as in the harness's own pools
        return RankResult.from_exception(ctx.rank, e)


class LaunchedPool:
    """The launched ranks behind WorkerPool's interface (`run`, `procs`, `restart`, `close`)."""

    def __init__(self, device: str, collective_timeout_s: float, tp: int | None = None):
        if device == "cuda" and not torch.cuda.is_available():
            raise LaunchError("--device cuda, but CUDA is not available on this node")
        self.world = world_size()
        self.tp = tp or self.world
        self.dp = self.world // self.tp
        self.collective_timeout_s = collective_timeout_s
        self.restarts = 0
        cuda = torch.cuda.is_available()
        local = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(local)
        trace.install()  # before any target import, as in the pools' workers
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo", init_method="env://",
                                    timeout=timedelta(seconds=collective_timeout_s))
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        assert isinstance(control, dist.ProcessGroup)  # every rank of the world is a member
        self.control = control
        self.ctx = RankContext(dist.get_rank(), self.world, local)
        self.procs = list(range(self.world))  # the launched ranks; the launcher owns their processes
        self._init_tp()

    def _init_tp(self) -> None:
        from megatron.core import parallel_state

        # The minutes are annotated int by megatron-core, which takes timedelta(minutes=...) of them.
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tp,
            distributed_timeout_minutes=self.collective_timeout_s / 60)  # pyright: ignore[reportArgumentType]

    def _rebuild_tp(self) -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        self._init_tp()

    def _send(self, message: tuple) -> None:
        dist.broadcast_object_list([message], src=0, group=self.control)

    def run(self, fn_path: str, *args: Any, deadline_s: float | None = None,
            while_waiting: Callable[[], Any] | None = None) -> list[Any]:
        """`fn_path(ctx, *args)` on every launched rank (the driver included), results in rank order.
        `deadline_s` is not enforced: the TP groups' collective timeout bounds a stuck collective.
        `while_waiting` runs first: the driver is a rank here, so there is no wait to fill."""
        if while_waiting is not None:
            try:
                while_waiting()
            except Exception:
                pass
        self._send(("job", fn_path, args))
        results: list[Any] = [None] * self.world
        dist.gather_object(_call(self.ctx, fn_path, args), results, dst=0, group=self.control)
        return results

    def restart(self) -> None:
        """Fresh TP groups on every rank, after a case that may have left collectives unmatched."""
        self._send(("restart",))
        self._rebuild_tp()
        self.restarts += 1

    def close(self) -> None:
        """Nothing to close per runner: the launched ranks live until `stop`."""

    def serve(self) -> int:
        """The loop of ranks other than 0: run jobs until stop; return the driver's exit code."""
        while True:
            message: list[Any] = [None]
            dist.broadcast_object_list(message, src=0, group=self.control)
            kind, *payload = message[0]
            if kind == "stop":
                self._teardown()
                return int(payload[0])
            if kind == "restart":
                self._rebuild_tp()
                continue
            fn_path, args = payload
            dist.gather_object(_call(self.ctx, fn_path, args), None, dst=0, group=self.control)

    def stop(self, code: int) -> None:
        """Driver only: release the serving ranks with the run's exit code."""
        self._send(("stop", int(code)))
        self._teardown()

    def _teardown(self) -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


_POOL: LaunchedPool | None = None


def start(tp_sizes: list[int], device: str, collective_timeout_s: float) -> LaunchedPool:
    """Join the launched world (on every rank); `tp_sizes` must be one size dividing the world size."""
    global _POOL
    tp = check_sizes(tp_sizes)
    _POOL = LaunchedPool(device, collective_timeout_s, tp)
    return _POOL


class _SpawnedPool(WorkerPool):
    """A pool of the driver's own whose workers start clean: a forked child would inherit the
    launched process group and could not join one of its own."""

    def start(self) -> None:
        self.start_method = "spawn"
        super().start()


def pool(tp: int) -> LaunchedPool | WorkerPool | None:
    """The pool for a runner's TP-`tp` cases, or None when this process launched nothing. TP 1 in a
    larger world is the reference of tp-invariance: it runs in one local worker of the driver."""
    if _POOL is None:
        return None
    if tp == 1 and _POOL.tp > 1:
        return _SpawnedPool(1, _POOL.ctx.device.type, _POOL.collective_timeout_s)
    if tp != _POOL.tp:
        raise LaunchError(f"this launched world serves TP {_POOL.tp} cases (x DP {_POOL.dp}), not TP {tp}")
    return _POOL


def drive(main: Callable[[], int], tp_sizes: list[int], device: str, collective_timeout_s: float) -> int:
    """Run `main` on rank 0 over the launched ranks; the other ranks serve and return its exit code."""
    if rank() != 0:
        try:
            served = start(tp_sizes, device, collective_timeout_s)
        except LaunchError:
            return 2  # rank 0 raises the same error and says why
        return served.serve()
    driver = start(tp_sizes, device, collective_timeout_s)
    code = 2
    try:
        code = main()
    finally:
        driver.stop(code)
    return code


def serving(command: Callable[[Namespace, "RunConfig"], int]) -> Callable[[Namespace, "RunConfig"], int]:
    """For a CLI command with --tp/--device/--collective-timeout: under torchrun, `drive` it."""
    @functools.wraps(command)
    def run(ns: Namespace, cfg: "RunConfig") -> int:
        if not active():
            return command(ns, cfg)
        return drive(lambda: command(ns, cfg), cfg.tp, cfg.device, cfg.collective_timeout_s)
    return run
