"""Which memory ledger a process uses, and the build of the C++ one (`ledger.cpp`).

`HARNESS_LEDGER=cpp|python` chooses; unset, the C++ ledger is used where it builds and the Python
one (`memory_meter.ModeLedger`, the reference the C++ one is held to) where it does not, saying why once.

The build is cached under a name that hashes the source and everything its compile and link
commands depend on (`compile_inputs`): torch's extension loader writes them into the build folder's
`build.ninja`, and ninja rebuilds whenever a command differs from the one its log recorded. So two
builds that would differ get two folders, and processes that would build alike share one, however
they were started. The environment's prefix (`sys.prefix`) is in the name too: two virtual
environments on one machine (two tox envs, two CI jobs) each build theirs once.

The ninja that runs the build is the environment's own (the `ninja` package, a dependency), put first
on PATH for the build: ninja versions do not read each other's build log (1.13 starts it over, 1.11
takes 1.13's entries for changed commands), so a process started with the environment's `bin` on
PATH and one started without it would otherwise rebuild the one folder in turn.

Builds of one name are serialised by an `flock`, which the kernel releases when its holder dies.
Holding it, a torch build lock (`lock` in the build directory) can only be one a killed build left
behind, and is removed: torch would otherwise wait on it forever.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

from harness.base.errors import HarnessError, UsageError

ENV = "HARNESS_LEDGER"
CHOICES = ("cpp", "python")
SOURCE = Path(__file__).with_name("ledger.cpp")
# NDEBUG as torch's release builds have it: without it, RecordFunction's inline accessors assert on
# state that only a debug build of torch keeps.
FLAGS = ["-O2", "-DNDEBUG"]


def chosen() -> str | None:
    """`HARNESS_LEDGER`: "cpp", "python", or None (unset: the C++ one where it builds)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value and value not in CHOICES:
        raise UsageError(f"{ENV}={value!r}: one of {', '.join(CHOICES)} (unset: cpp where it builds, else python)")
    return value or None


def ninja_folder() -> str | None:
    """The folder of the environment's own ninja (the `ninja` package), or None without one."""
    try:
        import ninja
    except ImportError:
        return None
    folder = getattr(ninja, "BIN_DIR", None)
    return folder if folder and os.access(os.path.join(folder, "ninja"), os.X_OK) else None


def build_path() -> str:
    """PATH for the build: the environment's ninja first, then the process's PATH."""
    return os.pathsep.join(p for p in (ninja_folder(), os.environ.get("PATH")) if p)


def compile_inputs() -> list[str]:
    """What the build's commands depend on besides the source's text, as torch's loader writes
    them: the compiler (`CXX`) and the wrapper it puts before it (ccache or sccache on PATH), torch's
    include and library folders, Python's headers, the source's path, the flags; and the ninja that
    runs them."""
    import torch
    from torch.utils import cpp_extension

    path = build_path()
    wrappers = [] if os.environ.get("TORCH_NO_COMPILER_WRAPPER") else [
        shutil.which(w, path=path) or "-" for w in ("ccache", "sccache")]
    return [torch.__version__, sys.version, os.path.realpath(sys.prefix), str(SOURCE.resolve()), *FLAGS,
            cpp_extension.get_cxx_compiler(), *wrappers, os.path.realpath(shutil.which("ninja", path=path) or "-"),
            *cpp_extension.include_paths(), cpp_extension.TORCH_LIB_PATH,
            sysconfig.get_path("include", scheme="posix_prefix") or "-"]


def extension_name() -> str:
    key = b"\0".join([SOURCE.read_bytes(), *(s.encode() for s in compile_inputs())])
    return "harness_ledger_" + hashlib.sha1(key).hexdigest()[:16]


@contextlib.contextmanager
def environment_ninja() -> Iterator[None]:
    """PATH as `build_path()` while torch looks for ninja and runs it."""
    before = os.environ.get("PATH")
    os.environ["PATH"] = build_path()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


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
    """The C++ ledger's class, built at its first use in an environment (about 20 s) and
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
        print(f"harness: building the C++ memory ledger for this environment (once; about 20 s) "
              f"in {where} ...", end="", file=sys.stderr, flush=True)
    try:
        where.mkdir(parents=True, exist_ok=True)
        with open(where / "harness.flock", "w") as guard, environment_ninja():
            fcntl.flock(guard, fcntl.LOCK_EX)
            (where / "lock").unlink(missing_ok=True)
            module = cpp_extension.load(name=name, sources=[str(SOURCE.resolve())], extra_cflags=FLAGS,
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
