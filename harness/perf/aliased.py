"""Another tree's routine, importable beside this one: the routine of the commit before timed against
the current one in the same process (`harness history --perf`, docs/performance.md).

Two commits of a repository hold the same module names (`slime.utils.ppo_utils` in both), so the
older one cannot simply be imported next to the newer. `write_shim` writes a small module file of a
name of its own; a pool worker imports it as any file target (`load_target(path)`), and the shim
calls `load(tree, target)`: the target is imported with `tree` first on `sys.path` and the current
modules of the tree's top-level packages set aside; what that import loaded is then taken out of
`sys.modules` again and the set-aside modules put back. The old modules keep references to the old
modules they imported, and the imports they make later (inside a function, as adapters and trainers
often do) go through an `__import__` of their own that answers from the old tree. An adapter target
(`harness.targets.peers.nemo_rl`: a harness module that imports the peer's tree at call time) is
imported afresh the same way, so its copy calls the old tree.

Not covered: `importlib.import_module` calls inside the old code (they find the current modules),
and a peer file loaded by `peers._source` (its own loader) when it imports lazily.
"""
from __future__ import annotations

import builtins
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

HARNESS_ROOT = Path(__file__).resolve().parents[2]

SHIM = '''"""The routine {target} of the tree {tree}, under a name of its own (harness.perf.aliased)."""
from harness.perf.aliased import load

globals().update(load({tree!r}, {target!r}))
'''


def write_shim(tree: Path, target: str, folder: Path, tag: str) -> Path:
    """A module file that, imported, is `target` as `tree` has it; give it to `load_target`. `folder`
    must hold no `__init__.py` (the file's stem is its module name)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"_harness_prev_{re.sub(r'[^0-9A-Za-z_]', '_', tag)}.py"
    path.write_text(SHIM.format(tree=str(Path(tree).resolve()), target=target))
    return path


def _tops(root: Path) -> frozenset[str]:
    """The top-level module names `root` provides, less the harness's own (its `tests`, `cases`)."""
    names = {p.stem if p.suffix == ".py" else p.name for p in root.iterdir()
             if (p.is_dir() or p.suffix == ".py") and (p.stem if p.suffix == ".py" else p.name).isidentifier()}
    return frozenset(n for n in names if not _harness_name(n))


def _harness_name(top: str) -> bool:
    """Whether top-level name `top` is found in the harness's own folder (`harness`, its `tests`)."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    where = [*(spec.submodule_search_locations or ()), spec.origin or ""] if spec is not None else []
    return any(w and Path(w).resolve().is_relative_to(HARNESS_ROOT) for w in where)


class _Loader(importlib.abc.Loader):
    """A module of the alias: executed with the alias's `__builtins__`, whose `__import__` answers
    its later imports from the old tree."""

    def __init__(self, inner: Any, builtins_: dict[str, Any]):
        self.inner, self.builtins = inner, builtins_

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # Functions capture their builtins when defined: set before the module's code runs.
        module.__dict__["__builtins__"] = self.builtins
        self.inner.exec_module(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package: the inner loader's
        return getattr(self.inner, name)


class Alias(importlib.abc.MetaPathFinder):
    """The modules of one tree's target, kept out of `sys.modules` except while they import."""

    def __init__(self, tree: Path, target: str):
        self.root, self.target = Path(tree).resolve(), target
        top = target.split(".")[0]  # a module of the tree's (`slime.utils.ppo_utils`), not an adapter's
        self.tops = _tops(self.root) | ({top} if not _harness_name(top) else set())
        self.loaded: dict[str, ModuleType] = {}
        self.depth = 0  # imports under way inside `active`: a nested one must not swap again
        self.builtins = dict(vars(builtins), __import__=self._import)

    def ours(self, name: str) -> bool:
        return name == self.target or name.split(".")[0] in self.tops

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not self.ours(name):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, self.builtins)
                return spec
        return None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The alias's modules in `sys.modules` and its tree first on `sys.path`; afterwards the
        current ones back, and what was imported meanwhile kept in the alias. Re-entrant: a module
        of the alias that imports while it executes finds its half-imported parents in place."""
        if self.depth:
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
            return
        self.depth = 1
        current = {m: sys.modules.pop(m) for m in [m for m in sys.modules if self.ours(m)]}
        sys.modules.update(self.loaded)
        sys.path.insert(0, str(self.root))
        sys.meta_path.insert(0, self)
        importlib.invalidate_caches()
        try:
            yield
        finally:
            self.depth = 0
            sys.meta_path.remove(self)
            sys.path.remove(str(self.root))
            mine = {m: sys.modules.pop(m) for m in [m for m in sys.modules if self.ours(m)]}
            self.loaded.update(mine)
            sys.modules.update(current)
            for name, module in mine.items():  # a parent package's attribute names the current module again
                parent, _, child = name.rpartition(".")
                if parent in sys.modules and getattr(sys.modules[parent], child, None) is module:
                    if name in current:
                        setattr(sys.modules[parent], child, current[name])
                    else:
                        delattr(sys.modules[parent], child)
            importlib.invalidate_caches()

    def _import(self, name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        absolute = importlib.util.resolve_name("." * level + name, (globals or {}).get("__package__")) \
            if level else name
        if not self.ours(absolute):
            return builtins.__import__(name, globals, locals, fromlist, level)
        found = self.loaded.get(absolute)  # the common case, with no swapping: already imported
        if found is not None and level == 0:
            if not fromlist:
                top = self.loaded.get(absolute.partition(".")[0])
                if top is not None:
                    return top
            elif all(f == "*" or hasattr(found, f) for f in fromlist):
                return found
        with self.active():
            return builtins.__import__(name, globals, locals, fromlist, level)

    def module(self) -> ModuleType:
        with self.active():
            return importlib.import_module(self.target)


_aliases: dict[tuple[str, str], ModuleType] = {}


def load(tree: str, target: str) -> dict[str, Any]:
    """The attributes of module `target` as `tree` has it (its contract functions, its declaration),
    the current modules of the same names left in place."""
    key = (str(Path(tree).resolve()), target)
    if key not in _aliases:
        _aliases[key] = Alias(Path(tree), target).module()
    return {k: v for k, v in vars(_aliases[key]).items() if not (k.startswith("__") and k.endswith("__"))}
