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

`PeerSource.find(name)` follows a routine through a trainer's layouts by what it is: a function, a
class, or a method (`"Class.method"`), looked for in each of `files`, newest layout first. Only its
definition is compiled, not the file around it (a trainer's module imports its whole stack), and
the names it uses are resolved from that file's top level when first read: the peer's own modules
file by file (never their package `__init__`), other packages by importing them, `provides` (an
adapter's named substitutes) before either. A method comes in a class holding it and the methods
it reaches through `self`; the adapter sets the attributes the trainer's `__init__` would. A name
that cannot be resolved raises ImportError naming the dependency that is not installed (or the
adapter's stub that lacks it), so `harness history` says why a commit is untestable.
"""
from __future__ import annotations

import ast
import builtins
import copy
import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

_T = TypeVar("_T")


class RoutineMissing(ImportError):
    """The peer's tree is on sys.path but this commit has no routine the adapter can call."""


@dataclass(frozen=True)
class PeerSource:
    peer: str  # the peer's name, for messages
    files: tuple[str, ...]  # the routine's file, relative to the tree's root, at each past location
    markers: tuple[str, ...]  # folders, relative to the root, that only the peer's tree has
    stubs: dict[str, dict[str, Any]] = field(default_factory=dict)  # module -> attributes the file binds
    how: str = ""  # how to get the tree
    provides: dict[str, Any] = field(default_factory=dict)  # `find`: a global name -> the adapter's substitute

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

    def find(self, name: str) -> Any:
        """`name` (a function, a class or `"Class.method"`) from the first of `files` that defines it,
        newest layout first: None without the peer's tree on sys.path, RoutineMissing when no file
        defines it; ImportError naming the dependency when a name it uses cannot be resolved."""
        roots = self.roots()
        if not roots:
            return None
        root = roots[0]  # the tree Python imports the peer from (a commit's, before an installed copy)
        for rel in self.files:
            if (root / rel).is_file() and _defines(root / rel, name):
                return _tree(self, root).module(root / rel).definition(name)
        raise RoutineMissing(f"{self.peer}'s tree `{root.name}` defines no {name} in any of {', '.join(self.files)}")

    def defines(self, name: str) -> bool | None:
        """Whether a file of the first tree on sys.path defines `name` (read, not run); None without one."""
        roots = self.roots()
        if not roots:
            return None
        return any((roots[0] / rel).is_file() and _defines(roots[0] / rel, name) for rel in self.files)

    def require(self, found: _T | None) -> _T:
        """The loaded module (or found routine), or ImportError saying how to get the peer."""
        if found is None:
            raise ImportError(f"{self.peer}'s source tree is not on PYTHONPATH: {self.how}")
        return found


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
        try:
            spec.loader.exec_module(module)
        except ImportError as e:
            stub = next((m for m in added if m == e.name or f"from '{m}'" in str(e)), None)
            if stub is None:
                raise
            held = ", ".join(sorted(stubs[stub])) or "nothing"
            raise ImportError(f"{path}: {e}: {stub} is the adapter's stub (holding {held}), which lacks what this "
                              f"commit imports from it") from e
        return module
    finally:
        for mod in added:
            sys.modules.pop(mod, None)


def missing(source: PeerSource, module: types.ModuleType, *names: str) -> None:
    """RoutineMissing unless `module` defines every one of `names`."""
    absent = [n for n in names if not hasattr(module, n)]
    if absent:
        raise RoutineMissing(f"{source.peer}'s {module.__file__} defines no {', '.join(absent)} at this commit")


# ---- `PeerSource.find`: a definition compiled alone, its names resolved from its file when first read ----

def _defines(path: Path, name: str) -> bool:
    """Whether the file defines `name` (a def or class at its top level, or `Class.method`)."""
    cls, _, method = name.rpartition(".")
    for node in _parse(path).body:
        if not cls and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if cls and isinstance(node, ast.ClassDef) and node.name == cls:
            return any(isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name == method for m in node.body)
    return False


_ASTS: dict[Path, ast.Module] = {}


def _parse(path: Path) -> ast.Module:
    if path not in _ASTS:
        _ASTS[path] = ast.parse(path.read_text(encoding="utf-8", errors="replace"), str(path))
    return _ASTS[path]


def _bound(node: ast.stmt) -> set[str]:
    """The names a top-level statement binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Import):
        return {a.asname or a.name.split(".")[0] for a in node.names}
    if isinstance(node, ast.ImportFrom):
        return set() if node.module == "__future__" else {a.asname or a.name for a in node.names if a.name != "*"}
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for inner in ast.walk(node):  # a try/if holding imports or defs (an optional dependency's fallback)
        if inner is not node and isinstance(inner, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)):
            names |= _bound(inner)
    return names


def _type_checking(node: ast.If) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): a branch that runs only under a type checker."""
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


_TREES: dict[tuple[int, Path], _Tree] = {}


def _tree(source: PeerSource, root: Path) -> _Tree:
    """One tree per adapter's source and root, so that a file's definitions share one module namespace."""
    key = (id(source), root.resolve())
    if key not in _TREES or _TREES[key].source is not source:
        _TREES[key] = _Tree(source, root)
    return _TREES[key]


class _Tree:
    """The peer's tree at one root: its files as modules of definitions, each compiled when reached."""

    def __init__(self, source: PeerSource, root: Path):
        self.source, self.root = source, root
        self.packages = {Path(m).parts[0] for m in source.markers}  # the peer's own top-level packages
        self.modules: dict[Path, _Module] = {}

    def module(self, path: Path) -> _Module:
        if path not in self.modules:
            self.modules[path] = _Module(self, path)
        return self.modules[path]

    def file_of(self, dotted: str) -> Path | None:
        base = self.root.joinpath(*dotted.split("."))
        return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)

    def attr(self, dotted: str, attr: str, where: str) -> Any:
        """`from dotted import attr`, as the peer's file at `where` does."""
        stubs = self.source.stubs
        if dotted in stubs:
            if attr not in stubs[dotted]:
                raise ImportError(f"{where} imports {attr} from {dotted}, which is the adapter's stub (holding "
                                  f"{', '.join(sorted(stubs[dotted])) or 'nothing'}) and lacks it")
            return stubs[dotted][attr]
        if dotted.split(".")[0] in self.packages:
            file = self.file_of(dotted)
            if file is not None and attr in self.module(file).bindings:
                return self.module(file).need(attr)
            if self.file_of(f"{dotted}.{attr}") is not None:
                return self.lazy(f"{dotted}.{attr}")
            raise ImportError(f"{where} imports {attr} from {dotted}, which {self.source.peer}'s tree at this commit "
                              f"does not define")
        module = _import(dotted, where)
        try:
            return getattr(module, attr)
        except AttributeError:
            return _import(f"{dotted}.{attr}", where)

    def lazy(self, dotted: str) -> types.ModuleType:
        """A module of the peer's own whose attributes are found when read (its `__init__` never runs)."""
        module = types.ModuleType(dotted)
        module.__getattr__ = lambda attr: self.attr(dotted, attr, dotted)  # type: ignore[attr-defined]
        return module


def _import(dotted: str, where: str) -> Any:
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"{where} imports {dotted}: {e} (not installed here)", name=e.name) from e


class _Globals(dict):
    """A definition's module namespace: a name of its file's top level is resolved when first read."""

    def __init__(self, module: _Module):
        super().__init__(__name__=module.name, __file__=str(module.path), __builtins__=builtins)
        self.module = module

    def __missing__(self, key: str) -> Any:
        if key in self.module.bindings or key in self.module.tree.source.provides:
            return self.module.need(key)
        raise KeyError(key)


class _Module:
    def __init__(self, tree: _Tree, path: Path):
        self.tree, self.path = tree, path
        self.rel = path.relative_to(tree.root)
        parts = self.rel.with_suffix("").parts
        self.dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        self.package = self.dotted if path.name == "__init__.py" else self.dotted.rpartition(".")[0]
        self.name = f"_harness_peer.{tree.source.peer}.{self.dotted}"
        body = _parse(path).body
        self.future = [n for n in body if isinstance(n, ast.ImportFrom) and n.module == "__future__"]
        self.bindings: dict[str, ast.stmt] = {}
        self.earlier: dict[int, dict[str, ast.stmt]] = {}  # per statement, the bindings before it of names it rebinds
        for node in body:
            for name in _bound(node):
                if name in self.bindings:
                    self.earlier.setdefault(id(node), {})[name] = self.bindings[name]
                self.bindings[name] = node  # the last binding, as at the end of the module's run
            if isinstance(node, ast.If) and _type_checking(node):
                # A lazy package `__init__` (transformers' `_LazyModule`) binds its names at run time
                # through `sys.modules`, in its `else`; its `if TYPE_CHECKING:` imports say where each
                # lives. A name only that branch binds is found by its import there.
                at_run_time = {n for inner in node.orelse for n in _bound(inner)}
                for inner in node.body:
                    for name in _bound(inner) - at_run_time:
                        self.bindings[name] = inner
        self.ns = _Globals(self)
        self.shadow = types.ModuleType(self.name)  # what dataclasses and pickling find in sys.modules
        sys.modules[self.name] = self.shadow

    def where(self, node: ast.stmt) -> str:
        return f"{self.tree.source.peer}'s {self.rel.as_posix()}:{node.lineno}"

    def need(self, name: str, binding: ast.stmt | None = None) -> Any:
        """The value `name` has at this file's top level (or as `binding` binds it), compiled or imported
        on first use."""
        if binding is None and dict.__contains__(self.ns, name):
            return dict.__getitem__(self.ns, name)
        provides = self.tree.source.provides
        if name in provides:
            value = provides[name]
        else:
            node = binding or self.bindings[name]
            if isinstance(node, ast.ImportFrom):
                alias = next(a for a in node.names if (a.asname or a.name) == name)
                value = self.tree.attr(self.absolute(node), alias.name, self.where(node))
            elif isinstance(node, ast.Import):
                alias = next(a for a in node.names if (a.asname or a.name.split(".")[0]) == name)
                dotted = alias.name if alias.asname else alias.name.split(".")[0]
                value = self.tree.lazy(dotted) if dotted.split(".")[0] in self.tree.packages else \
                    _import(dotted, self.where(node))
                if not alias.asname and dotted not in self.tree.packages:
                    _import(alias.name, self.where(node))  # `import a.b` binds `a` with `a.b` loaded
            else:
                self.run(node)
                if not dict.__contains__(self.ns, name):
                    raise ImportError(f"{self.where(node)} binds {name} only on a branch not taken here")
                value = dict.__getitem__(self.ns, name)
        self.ns[name] = value
        self.shadow.__dict__[name] = value
        return value

    def absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = self.package.split(".")
        base = base[:len(base) - node.level + 1]
        return ".".join([*base, *([node.module] if node.module else [])])

    def run(self, node: ast.stmt) -> None:
        # A class body reads its module's names as a dict lookup that skips `_Globals.__missing__`:
        # what a definition reads when it runs (decorators, bases, a class body, defaults and, unless the
        # file defers them, annotations) is resolved first; function bodies resolve theirs when called.
        rebinds = self.earlier.get(id(node), {})
        for name in _read_at_definition(node, lazy_annotations=bool(self.future)):
            if name in rebinds and not dict.__contains__(self.ns, name):
                self.need(name, rebinds[name])  # `f = torch.compile(f)`: it reads the `f` bound before it
            elif (name in self.bindings and self.bindings[name] is not node) or name in self.tree.source.provides:
                self.need(name)  # a name the statement binds itself is its own, not a dependency
        code = compile(ast.Module(body=[*self.future, node], type_ignores=[]), str(self.path), "exec")
        exec(code, self.ns)  # noqa: S102 - the peer's own definition, compiled from its file

    def definition(self, name: str) -> Any:
        """`name` or `Class.method` compiled, with every name its code reads resolved now, so that a
        dependency that is missing is said before any case runs."""
        cls, _, method = name.rpartition(".")
        if not cls:
            value = self.need(name)
        else:
            value = self.method_class(cls, method)
        _prefetch(value, set())
        return value

    def method_class(self, cls: str, method: str) -> type:
        """The trainer's class holding `method` and the methods it reaches through `self`, without its
        bases (the trainer's stack): an instance of it is the adapter's, with the attributes it sets."""
        node = next(n for n in _parse(self.path).body if isinstance(n, ast.ClassDef) and n.name == cls)
        methods = {m.name: m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
        keep, todo = set(), [method]
        while todo:
            m = todo.pop()
            if m in keep or m not in methods:
                continue
            keep.add(m)
            todo += [a.attr for a in ast.walk(methods[m]) if isinstance(a, ast.Attribute)
                     and isinstance(a.value, ast.Name) and a.value.id == "self"]
        lean = copy.copy(node)
        lean.bases, lean.keywords, lean.decorator_list = [], [], []
        lean.body = [m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name in keep]
        self.run(lean)
        value = dict.pop(self.ns, cls)  # the lean class is not the module's own binding of `cls`
        return value


def _read_at_definition(node: ast.AST, lazy_annotations: bool) -> set[str]:
    """The names a statement reads when it runs, leaving out the bodies of the functions it defines."""
    out: set[str] = set()
    todo: list[ast.AST] = [node]
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            out.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = n.args
            todo += [*args.defaults, *(d for d in args.kw_defaults if d is not None)]
            if not isinstance(n, ast.Lambda):
                todo += n.decorator_list
                if not lazy_annotations:
                    todo += [a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs,
                                                    *filter(None, (args.vararg, args.kwarg))) if a.annotation]
                    todo += [n.returns] if n.returns else []
        elif isinstance(n, ast.AnnAssign) and lazy_annotations:
            todo += [n.target, *([n.value] if n.value else [])]
        else:
            todo += list(ast.iter_child_nodes(n))
    return out


def _prefetch(value: Any, seen: set[int]) -> None:
    """Resolve every top-level name the code of `value` (a function, or a class's methods) reads, and
    theirs: a missing dependency is an ImportError here, not a crash inside a case."""
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, type):
        for attr in vars(value).values():
            _prefetch(getattr(attr, "__func__", attr), seen)
        return
    if not isinstance(value, types.FunctionType) or not isinstance(value.__globals__, _Globals):
        return
    ns = value.__globals__
    for name in _names(value.__code__):
        if name in ns.module.bindings or name in ns.module.tree.source.provides:
            _prefetch(ns[name], seen)


def _names(code: types.CodeType) -> set[str]:
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= _names(const)
    return out
