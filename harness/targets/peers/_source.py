"""A peer's routine loaded from its own source file, as it is at whatever commit is on `sys.path`.

Trainers' packages import their whole training stack from `__init__` (ray, vLLM, transformers,
their configs); the log-prob routines themselves need torch and, at most, megatron-core. An
adapter names the file (each of its past locations, newest first) and `load` executes that file
alone as a private module, with `stubs`: module names the file imports for things the routine
never calls (a logger, a config reader), each given as an empty module with the attributes the
file binds at import. Every adapter lists its stubs and why they are honest.

`PeerSource.load()` says which of three states a machine is in:
- the peer's tree is not on `sys.path` (no marker folder found): None, the adapter's calls then
  say how to get it;
- the tree is there and the file loads: the module;
- the tree is there but the file or the routine is not (a commit before it existed, after it
  moved away): `RoutineMissing`, raised at the adapter's import, so `harness check` refuses the
  target with that reason and `harness history` marks the commit `untestable`.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class RoutineMissing(ImportError):
    """The peer's tree is on sys.path but this commit has no routine the adapter can call."""


@dataclass(frozen=True)
class PeerSource:
    peer: str  # the peer's name, for messages
    files: tuple[str, ...]  # the routine's file, relative to the tree's root, at each past location
    markers: tuple[str, ...]  # folders, relative to the root, that only the peer's tree has
    stubs: dict[str, dict[str, Any]] = field(default_factory=dict)  # module -> attributes the file binds
    how: str = ""  # how to get the tree

    def roots(self) -> list[Path]:
        """The `sys.path` entries that hold the peer's tree."""
        out = []
        for entry in sys.path:
            root = Path(entry or ".")
            if any((root / m).is_dir() for m in self.markers) and root not in out:
                out.append(root)
        return out

    def load(self) -> types.ModuleType | None:
        roots = self.roots()
        if not roots:
            return None
        for root in roots:
            for rel in self.files:
                if (root / rel).is_file():
                    return _exec_file(root / rel, f"_harness_peer_{self.peer.lower().replace('-', '_')}", self.stubs)
        raise RoutineMissing(f"{self.peer}'s tree at {roots[0]} has none of {', '.join(self.files)}")

    def require(self, module: types.ModuleType | None) -> types.ModuleType:
        """The loaded module, or ImportError saying how to get the peer."""
        if module is None:
            raise ImportError(f"{self.peer}'s source tree is not on PYTHONPATH: {self.how}")
        return module


def _exec_file(path: Path, name: str, stubs: dict[str, dict[str, Any]]) -> types.ModuleType:
    """Execute one source file as module `name`, with the stub modules in place only while it runs
    (modules already imported are left alone; the stubs' packages are never imported: a module in
    sys.modules is found without its parents)."""
    added = []
    for mod, attrs in stubs.items():
        if mod in sys.modules:
            continue
        stub = types.ModuleType(mod)
        stub.__dict__.update(attrs)
        sys.modules[mod] = stub
        added.append(mod)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look the module up by name
        spec.loader.exec_module(module)
        return module
    finally:
        for mod in added:
            sys.modules.pop(mod, None)


def missing(source: PeerSource, module: types.ModuleType, *names: str) -> None:
    """RoutineMissing unless `module` defines every one of `names`."""
    absent = [n for n in names if not hasattr(module, n)]
    if absent:
        raise RoutineMissing(f"{source.peer}'s {module.__file__} defines no {', '.join(absent)} at this commit")
