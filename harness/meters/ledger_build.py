"""Which memory ledger a process uses, and the build of the C++ one (`ledger.cpp`).

`HARNESS_LEDGER=cpp|python` chooses; unset, the C++ ledger is used where it builds and the Python
one (`memory_meter.ModeLedger`, the reference the C++ one is held to) where it does not, saying why once.

The build is cached per environment: its name hashes the source with the torch version, the Python
version and the environment's prefix (`sys.prefix`). Two virtual environments on one machine (two tox
envs, two CI jobs) each build theirs once and never rebuild each other's, as they would under one
name: torch rebuilds an extension whose build flags (its own include paths) changed. The source's
path is in the key too, so two checkouts sharing one environment do not rebuild each other's either.

Builds of one name are serialised by an `flock`, which the kernel releases when its holder dies.
Holding it, a torch build lock (`lock` in the build directory) can only be one a killed build left
behind, and is removed: torch would otherwise wait on it forever.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

from harness.base.errors import HarnessError, UsageError

ENV = "HARNESS_LEDGER"
CHOICES = ("cpp", "python")
SOURCE = Path(__file__).with_name("ledger.cpp")


def chosen() -> str | None:
    """`HARNESS_LEDGER`: "cpp", "python", or None (unset: the C++ one where it builds)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value and value not in CHOICES:
        raise UsageError(f"{ENV}={value!r}: one of {', '.join(CHOICES)} (unset: cpp where it builds, else python)")
    return value or None


def extension_name() -> str:
    import torch

    key = b"\0".join([SOURCE.read_bytes(), torch.__version__.encode(), sys.version.encode(),
                      os.path.realpath(sys.prefix).encode(), str(SOURCE.resolve()).encode()])
    return "harness_ledger_" + hashlib.sha1(key).hexdigest()[:16]


def build_directory(name: str) -> Path:
    """Where torch's extension cache keeps it (`TORCH_EXTENSIONS_DIR`, else torch's default root)."""
    from torch.utils import cpp_extension

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / name


def _why(e: BaseException) -> str:
    """The end of a build error (a compiler's last lines say what went wrong), one line."""
    if isinstance(e, RuntimeError) and "Ninja is required" in str(e):
        return "ninja is not installed (pip install ninja)"
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return (" / ".join(lines[-3:]) or type(e).__name__)[:400]


@functools.cache
def compiled() -> type | None:
    """The C++ ledger's class, built at its first use in an environment (about 40 s of CPU) and
    loaded from the cache after; None where the Python ledger is chosen or it cannot be built
    (said once, on stderr). With `HARNESS_LEDGER=cpp` a failed build is an error."""
    choice = chosen()
    if choice == "python":
        return None
    from torch.utils import cpp_extension

    name = extension_name()
    where = build_directory(name)
    built = (where / f"{name}.so").exists()
    start = time.perf_counter()
    if not built:
        print(f"harness: building the C++ memory ledger for this environment (once; about a minute on 2 cores) "
              f"in {where} ...", end="", file=sys.stderr, flush=True)
    try:
        where.mkdir(parents=True, exist_ok=True)
        # NDEBUG as torch's release builds have it: without it, RecordFunction's inline accessors
        # assert on state that only a debug build of torch keeps.
        with open(where / "harness.flock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            (where / "lock").unlink(missing_ok=True)
            module = cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=["-O2", "-DNDEBUG"],
                                        build_directory=str(where), verbose=False)
    except (OSError, RuntimeError, ImportError, subprocess.CalledProcessError) as e:
        if not built:
            print(" failed", file=sys.stderr, flush=True)
        if choice == "cpp":
            raise HarnessError(f"{ENV}=cpp, but the C++ memory ledger does not build: {_why(e)}") from None
        print(f"harness: the C++ memory ledger does not build ({_why(e)}); the Python ledger is used "
              f"({ENV}=python skips the attempt)", file=sys.stderr, flush=True)
        return None
    if not built:
        print(f" done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return module.Ledger  # pyright: ignore[reportAttributeAccessIssue] -- torch types load() as str | module
