"""Adapters for the field's routines: each module maps one peer's functions onto the contract.

An adapter is a target module like any other (`--target harness.targets.peers.NAME`) whose
declaration (`harness.targets.declaration`) also says where the peer comes from,
`HARNESS = Declaration(..., peer=PeerInfo(...))`:

- `requires`: the importable modules it needs (the adapter is "not installed" without them);
- `install`: the command that installs them;
- `upstream`: the functions adapted, as `package.module.function`;
- `profile` (optional): the profile `harness peers` checks it at, `ci` unless a peer's own
  sizes make a smaller one enough (the adapter says why).

`NAME.known.toml` next to an adapter lists what the harness finds in that peer (the `--known`
format, docs/known-findings.md), each with its reason; `harness peers` runs the peer with it, so the
matrix tells the explained findings from new ones.

Adapters import their peer lazily, inside the calls, so that every adapter's module (and its
declared capabilities) loads on any machine. They never clone or copy to protect a peer from
itself: where a peer writes into its input, the checks see it. Adding a peer is adding a module
here; `peers()` finds it.
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import pkgutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harness.base.errors import TargetError
from harness.cases.profiles import DEFAULT_PROFILE
from harness.targets import load_target
from harness.targets.declaration import declaration_of
from harness.targets.peers._source import PeerSource


@dataclass(frozen=True)
class Peer:
    name: str
    spec: str  # the target spec
    requires: tuple[str, ...]
    install: str
    upstream: tuple[str, ...]
    summary: str  # the module docstring's first paragraph
    cuda_only: bool
    known: Path | None  # NAME.known.toml, when there is one
    profile: str = DEFAULT_PROFILE  # the one `harness peers` checks it at
    # Why its adapter does not import here ("" when it does): a peer's tree on sys.path whose routine's
    # file imports a module not installed (NeMo-RL's imports hydra); its declaration is then unread.
    unimportable: str = ""

    def missing(self) -> list[str]:
        """The required modules that are not importable here."""
        return _missing(self.requires)


def _missing(requires: tuple[str, ...] | list[str]) -> list[str]:
    out = []
    for mod in requires:
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):  # a parent package missing
            found = False
        if not found:
            out.append(mod)
    return out


class _Unseen(Exception):
    """A package found where no file can be read (an extension module, a frozen one)."""


def _source_file(module: str) -> Path | None:
    """The source file of a dotted module, found without importing it (a trainer's package
    `__init__` imports its whole stack), or None. Its top-level package is looked for as Python
    looks: the first regular package or module on `sys.path`, else the folders of a namespace
    package (a folder named like a trainer's package in the current directory is one, holding none
    of its modules), else an import hook's (an editable install's finder). `_Unseen` when it is
    found where there is no file to read."""
    top = module.partition(".")[0]
    rel = Path(*module.split("."))
    roots: list[Path] = []
    for entry in sys.path:
        root = Path(entry or ".")
        if (root / top / "__init__.py").is_file() or (root / f"{top}.py").is_file():
            roots = [root]
            break
        if (root / top).is_dir():
            roots.append(root)  # a namespace package's portion, unless a regular package comes later
    if not roots:
        try:
            spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        if not spec.submodule_search_locations and not (spec.origin or "").endswith(".py"):
            raise _Unseen(module)
        roots = [Path(loc).parent for loc in spec.submodule_search_locations or ()] or [Path(str(spec.origin)).parent]
    for root in roots:
        for candidate in (root / rel.with_suffix(".py"), root / rel / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _bound_names(path: Path) -> set[str]:
    """The names a module's top level binds: defs, classes, assignments, imports."""
    return bound_names(path.read_text(encoding="utf-8", errors="replace"))


def bound_names(source: str) -> set[str]:
    """The names a module's source binds at its top level: defs, classes, assignments, imports
    (`*` for a star import); none when it does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def defines(module: str, name: str) -> bool | None:
    """Whether the tree on `sys.path` defines `module.name`, read from its source without importing
    it; None when no file of `module` is found. Adapters use it to follow a routine's past forms."""
    try:
        file = _source_file(module)
    except _Unseen:
        return None
    return None if file is None else name in _bound_names(file)


# A peer's tree whose routine is there may still not import here (a 2025 verl imports pkg_resources,
# which this setuptools no longer has): every case would be that ImportError as a `crash`.
IMPORT_PROBE_TIMEOUT_S = 180
# The child imports the module on this process's sys.path and writes the error's line after a
# marker (warnings share its stderr); os._exit skips the teardown of whatever the import started.
_MARK = "harness-import-probe: "
_PROBE = f"""
import importlib, json, os, sys
sys.path[:] = json.loads(sys.argv[1])
try:
    importlib.import_module(sys.argv[2])
except BaseException as e:
    said = [line.strip() for line in str(e).splitlines() if line.strip()]
    print("", {_MARK!r} + ": ".join([type(e).__name__, *said[-1:]]), sep="\\n", file=sys.stderr, flush=True)
    os._exit(1)
os._exit(0)
"""
_import_errors: dict[tuple[str, tuple[str, ...]], str | None] = {}  # (module, sys.path): its error, None: imports


def _import_error(module: str) -> str | None:
    """Why `module` cannot be imported here, in one line, or None: imported in a child process (on
    this sys.path), since a trainer's import can change torch's settings and the environment of the
    process that imports it. Once per module and sys.path in a process."""
    key = (module, tuple(sys.path))
    if key not in _import_errors:
        _import_errors[key] = _probe_import(module)
    return _import_errors[key]


def _installed(file: Path) -> bool:
    """Whether `file` belongs to an installed distribution, whose import is taken to work: probing
    costs the peer's whole import (seconds), paid only for a tree put on the path (a commit's)."""
    return not {"site-packages", "dist-packages"}.isdisjoint(file.parts)


def _probe_import(module: str) -> str | None:
    # stderr goes to a file, not a pipe: a process the import leaves behind cannot hold the probe open.
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as err:
        try:
            proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(sys.path), module],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                  timeout=IMPORT_PROBE_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return f"its import did not finish within {IMPORT_PROBE_TIMEOUT_S} s"
        if proc.returncode == 0:
            return None
        err.seek(0)
        lines = [line.strip() for line in err.read().splitlines() if line.strip()]
    marked = [line.removeprefix(_MARK) for line in lines if line.startswith(_MARK)]
    return (marked or lines or [f"the importing process exited {proc.returncode}"])[-1]


def absent_here(spec: str) -> str | None:
    """Why the peer adapter `spec` has nothing to call here, or None: a required module not
    installed, a tree on `sys.path` none of whose upstream functions exists (a commit before the
    routine, after it moved), or one whose functions' modules do not import here. The functions are
    found in the source, not imported (a package `__init__` imports a training stack), and their
    modules are imported in a child process, so that `harness check` refuses such a target (and
    `harness history` marks the commit untestable) instead of reporting every case as the adapter's
    import error. Adapters that import inside their calls rely on it."""
    module = sys.modules.get(spec)
    meta = declaration_of(module).peer if module is not None else None
    if meta is None:
        return None
    source = getattr(module, "SOURCE", None)
    if isinstance(source, PeerSource):
        # An adapter that loads its routine's own file finds it, or says why, itself, once its tree (or
        # the installed package) is on sys.path; without one, every case would be its ImportError.
        return None if source.roots() else f"{spec}: {source.peer}'s source is not on sys.path: {source.how}"
    missing = _missing(meta["requires"])
    if missing:
        return f"{spec} needs {', '.join(missing)}, not installed here: {meta['install']}"
    where: list[str] = []
    unimportable = None  # the first found whose module fails to import: the reason, unless another imports
    for path in meta["upstream"]:
        owner, _, name = path.split()[0].rpartition(".")  # an entry may carry a note: "pkg.fn (impl=...)"
        try:
            file = _source_file(owner)
        except _Unseen:
            return None  # installed where no source can be read: the calls will tell
        if file is None or name not in _bound_names(file):
            where.append(f"{name} in {file or owner}")
            continue
        error = None if _installed(file) else _import_error(owner)
        if error is None:
            return None
        unimportable = unimportable or f"{spec}: {owner} cannot be imported here: {error}"
    return unimportable or f"{spec}: the tree on sys.path has none of its routines ({'; '.join(where)})"


def peers() -> list[Peer]:
    """Every adapter in this package, in name order; one that does not import here is listed with
    why (`Peer.unimportable`), so that one peer's missing dependency does not hide the others."""
    out = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue  # shared helpers, not peers
        spec = f"{__name__}.{info.name}"
        try:
            module = importlib.import_module(spec)
        except ImportError as e:
            out.append(Peer(info.name, spec, (), "", (), _docstring(Path(__path__[0]) / f"{info.name}.py"), False, None,
                            unimportable=f"{type(e).__name__}: {e}"))
            continue
        meta = declaration_of(module).peer
        if meta is None:
            raise TargetError(f"{spec} is in the peers' package but declares no peer: HARNESS = Declaration(peer=...)")
        target = load_target(spec)
        out.append(Peer(info.name, spec, tuple(meta["requires"]), meta["install"], tuple(meta["upstream"]),
                        _summary(module.__doc__), not target.supports("cpu"),
                        known if (known := Path(__path__[0]) / f"{info.name}.known.toml").exists() else None,
                        meta.get("profile", DEFAULT_PROFILE)))
    return out


def _summary(doc: str | None) -> str:
    """A module docstring's first paragraph, on one line."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def _docstring(file: Path) -> str:
    """The summary of an adapter that does not import, read from its source."""
    try:
        return _summary(ast.get_docstring(ast.parse(file.read_text(encoding="utf-8"))))
    except (OSError, SyntaxError):
        return ""
