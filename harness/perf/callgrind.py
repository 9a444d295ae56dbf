"""A one-rank run under callgrind: the instructions executed by one forward+backward.

Wall-clock time on a shared 2-core box drifts by 30% and more between runs; the number of
instructions a single-threaded call executes does not. A child Python runs under
`valgrind --tool=callgrind` with instrumentation off (imports run at about 4x, not 50x) and
collection off. After the imports and warm-up calls it says so on stdout; the parent switches
instrumentation on with `callgrind_control -i on` and tells the child to go. The child runs each
measured call through `sys.call_tracing`, whose C function `_PyEval_CallTracing` is the
`--toggle-collect` marker: collection is on exactly while the routine runs, and `--dump-after`
writes one profile per call, so each dump holds that call's count and nothing else. The routine
gets a process group of one rank as its TP group, as a TP 1 case does on the pools (a trainer's
routine asks it for its rank, or all-reduces over it); the child imports the target from the
parent's PYTHONPATH (a user's or a commit's tree), and when it fails, the error says what the
child said last (`stderr_tail`).

Counts depend on the program and its environment (Python, torch, valgrind, the CPU features
valgrind emulates): `environment()` names them, and counts are only compared within one.
"""
from __future__ import annotations

import gc
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.base import levels
from harness.base.errors import InstructionCountError

MARKER = "_PyEval_CallTracing"  # the C function behind sys.call_tracing: called by nothing else we run
WARMUP_CALLS = 3  # lazy initialisation and Python's specializing interpreter settle before counting
REPEATS = 2  # measured calls per case: their agreement is the repeatability the record carries
TIMEOUT_S = 900.0
# PYTHONPATH carries a user's or a commit's tree to the child; TORCHDYNAMO_DISABLE decides whether a
# compiled routine runs compiled, as it does on the pools.
KEPT_ENV = ("PATH", "HOME", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "TORCHDYNAMO_DISABLE")
TAIL_LINES = 8  # of the child's stderr, in a failure's message


def available() -> str | None:
    """None when callgrind can be used here, else why not."""
    for tool in ("valgrind", "callgrind_control"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


def count(target_spec: str, cases: list[Any]) -> dict[str, Any]:
    """Instructions of one forward+backward per case (single rank, `tp_group=None`), in order.

    Returns {"environment": {...}, "cases": {case_spec: {"instructions": n, "repeats": [n, ...]}}}.
    Cases run in one process in the given order, so a comparison must use the same list.
    """
    why = available()
    if why:
        raise InstructionCountError(why)
    with tempfile.TemporaryDirectory(prefix="harness-callgrind-") as tmp:
        out = Path(tmp) / "cg.out"
        job = json.dumps({"target": target_spec, "cases": [c.spec() for c in cases]})
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
               f"--toggle-collect={MARKER}", f"--dump-after={MARKER}", f"--callgrind-out-file={out}",
               sys.executable, "-m", "harness.perf.callgrind", job]
        # A fixed environment: its size moves the stack, and with it the alignment of buffers, so
        # the caller's variables would change the count by a few thousand instructions.
        env = {k: os.environ[k] for k in KEPT_ENV if k in os.environ}
        env.update(PYTHONHASHSEED="0", OMP_NUM_THREADS="1")  # same dict layouts, one thread
        child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env)
        assert child.stdout is not None  # stdout=PIPE
        try:
            ready = child.stdout.readline()
            if not ready.startswith("ready"):
                child.kill()
                out, err = child.communicate(timeout=60)
                raise InstructionCountError(f"the callgrind child failed before measuring (exit {child.returncode}): "
                                            f"{stderr_tail(ready + out, err)}")
            environment = json.loads(ready.removeprefix("ready"))
            ctl = subprocess.run(["callgrind_control", "-i", "on", str(child.pid)], capture_output=True,
                                 text=True, timeout=120)
            if ctl.returncode != 0 or "OK" not in ctl.stdout:
                child.kill()
                raise InstructionCountError(f"callgrind_control could not switch instrumentation on: "
                                            f"{ctl.stdout[-500:]} {ctl.stderr[-500:]}")
            _, err = child.communicate("go\n", timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            raise InstructionCountError(f"the callgrind child did not finish within {TIMEOUT_S:.0f}s") from None
        if child.returncode != 0:
            raise InstructionCountError(f"the callgrind child exited with {child.returncode}: {stderr_tail('', err)}")
        counts = _dump_totals(out, len(cases) * REPEATS)
    per_case = {}
    for i, case in enumerate(cases):
        repeats = counts[i * REPEATS:(i + 1) * REPEATS]
        per_case[case.spec()] = {"instructions": repeats[0], "repeats": repeats}
    return {"environment": {**environment, "valgrind": _valgrind_version()}, "cases": per_case}


def stderr_tail(out: str, err: str) -> str:
    """What the child said last, without valgrind's own `==PID==` lines: the error that stopped it
    (a traceback's last lines), in one line."""
    lines = [line.strip() for line in (out + "\n" + err).splitlines()
             if line.strip() and not re.match(r"^==\d+==", line.strip())]
    return " | ".join(lines[-TAIL_LINES:]) or "no output"


def _dump_totals(base: Path, expected: int) -> list[int]:
    """The Ir total of each `--dump-after` dump, in order (`base.1`, `base.2`, ...)."""
    totals = []
    for part in range(1, expected + 1):
        path = base.with_name(f"{base.name}.{part}")
        if not path.exists():
            raise InstructionCountError(f"callgrind wrote {part - 1} dumps, expected {expected}")
        found = re.search(r"^(?:totals|summary): (\d+)", path.read_text(errors="replace"), re.M)
        if not found:
            raise InstructionCountError(f"no totals line in {path.name}")
        totals.append(int(found.group(1)))
    return totals


def _valgrind_version() -> str:
    return subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip()


# ---------------------------------------------------------------------------- the child, under valgrind
def _single_rank_group() -> Any:
    """A process group of one rank, passed as the TP group, as a TP 1 case has on the pools: a
    trainer's routine hands it to code that asks it for its rank (megatron-core's fused cross
    entropy), or all-reduces over the default group, and fails without one. Gloo through a file
    store: no network."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    store = os.path.join(tempfile.mkdtemp(prefix="harness-callgrind-store-"), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    return dist.group.WORLD


def _child(job: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    from harness.targets import load_target

    group = _single_rank_group()
    target = load_target(job["target"])
    calls = [levels.benchmark_call(target, levels.parse(spec), rank=0, device=torch.device("cpu"), group=group)
             for spec in job["cases"]]
    for call in calls:
        for _ in range(WARMUP_CALLS):
            call()
    environment = {"python": sys.version.split()[0], "torch": torch.__version__,
                   "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    print("ready" + json.dumps(environment), flush=True)
    # Spin rather than block: without ptrace rights, vgdb only reaches a process that is running.
    while not select.select([sys.stdin], [], [], 0)[0]:
        pass
    sys.stdin.readline()
    # The wait above allocated a varying amount: without this, a collection would fall inside a
    # counted call at a varying point.
    gc.collect()
    gc.disable()
    for call in calls:
        for _ in range(REPEATS):
            sys.call_tracing(call, ())
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: it would run instrumented, for nothing


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
