"""The package's imports run one way: no module of `harness` imports, directly or through others,
a module that imports it back, and no layer imports a layer above it. Every import counts, at module
level or inside a function; only `if TYPE_CHECKING:` blocks are exempt (they never run)."""
from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "harness"

# Low to high, one package per layer. A module may import its own layer or a lower one. The engine's
# rank side (what runs in the workers) sits below the checks, the driver (pools, runner, explorer)
# above them; the root package holds only the entry points (`ENTRY_POINTS`), above every layer.
LAYERS: tuple[str, ...] = (
    "harness.reference",  # the float64 oracle: pure math, no distribution, no I/O (the repo's reference/)
    "harness.cases",     # what to run: case dataclasses, strategies, profiles, the corpus (the repo's cases/)
    "harness.base",      # the harness's own errors, the options and the run's configuration
    "harness.meters",    # instruments: the collective trace, the memory meter
    "harness.targets",   # loading a target; the built-in routines, the mutation catalog, the peers
    "harness.engine",    # the rank side: the rank loop, a rank's shard of a case, the executor, observations
    "harness.checks",    # the check registry, the oracle and tolerances, findings, known findings
    "harness.levels",    # one module per level: its Level object, bundling what of the layers below is its own
    "harness.driver",    # the driver side: pools, torchrun, runner, explorer, limits, process state
    "harness.perf",      # the performance gate: baselines, timing jobs, clocks, callgrind
    "harness.report",    # the console printer, the result JSON, the HTML/markdown reports
    "harness.commands",  # the subcommands of `python -m harness`
    "harness",           # the entry points
)
# What the root package may hold besides its layer packages: the console script (`harness.cli:main`),
# `python -m harness`, the pytest plugin and the shipped conformance suite.
ENTRY_POINTS = ("harness.cli", "harness.__main__", "harness.plugin", "harness.conformance")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(top: Path) -> list[Path]:
    """The .py files under `top`, through the links that put the repository's cases/ and reference/
    into the package (installed, they are `harness.cases` and `harness.reference`)."""
    return [Path(d) / f for d, _, files in os.walk(top, followlinks=True) for f in files if f.endswith(".py")]


MODULES = {module_name(p): p for p in _sources(PACKAGE) if p != PACKAGE / "__init__.py"}  # the root is empty


def layer(module: str) -> int:
    """The index of the innermost layer package holding `module`."""
    best, depth = None, -1
    for i, package in enumerate(LAYERS):
        if (module == package or module.startswith(package + ".")) and len(package) > depth:
            best, depth = i, len(package)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def in_root(module: str) -> bool:
    """Whether `module` sits in the root package itself, not in one of its layer packages."""
    return LAYERS[layer(module)] == "harness"


def _runtime_nodes(tree: ast.AST):
    """Every node, except those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def imports(module: str) -> set[str]:
    """The harness modules `module` imports (a `from pkg import name` naming a submodule counts)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names]
            # `from pkg import mod` imports the module; `from pkg import name` imports pkg's __init__
            names = [n for n in subs if n in MODULES] + ([base] if any(n not in MODULES for n in subs) else [])
        else:
            continue
        found.update(n for n in names if n in MODULES and n != module)
    return found


GRAPH = {m: imports(m) for m in MODULES}


def test_every_module_is_in_a_layer_package():
    """A module outside the layer packages is one of the entry points (or inside the conformance suite)."""
    loose = [m for m in MODULES if in_root(m) and not any(m == e or m.startswith(e + ".") for e in ENTRY_POINTS)]
    assert not loose, f"modules in no layer package: {loose}; move each into one, or add its package to LAYERS"


def test_every_layer_is_a_package():
    for package in LAYERS[:-1]:
        assert package in MODULES, f"{package} is no package of harness"
    assert set(ENTRY_POINTS) <= set(MODULES), set(ENTRY_POINTS) - set(MODULES)


def test_no_import_points_up_a_layer():
    upward = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
              for a, deps in GRAPH.items() for b in deps if layer(b) > layer(a)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for dep in sorted(GRAPH[m]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_the_cycle_test_sees_cycles(monkeypatch):
    """The walk finds a cycle when there is one (a check that cannot fail is no check)."""
    monkeypatch.setitem(GRAPH, "harness.base.errors", {"harness.cli"})
    try:
        test_no_import_cycle()
    except AssertionError as e:
        assert "harness.base.errors" in str(e)
    else:
        raise AssertionError("a cycle through harness.base.errors went unseen")


# Names pytest or Python fix: every package has an __init__, every test folder may have a conftest.
FIXED_NAMES = {"__init__.py", "__main__.py", "conftest.py"}


def namesakes() -> dict[str, list[Path]]:
    """The project's modules (the package, tests, scripts, benchmarks) by file name, for names more
    than one of them has."""
    by_name: dict[str, list[Path]] = {}
    for top in ("harness", "tests", "scripts", "benchmarks"):
        for path in _sources(ROOT / top):
            if path.name not in FIXED_NAMES and "__pycache__" not in path.parts:
                by_name.setdefault(path.name, []).append(path)
    return {name: paths for name, paths in by_name.items() if len(paths) > 1}


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def _short(path: Path) -> str:
    """How a docstring names a module: its last folder and file (`checks/kernel.py`)."""
    return "/".join(path.relative_to(ROOT).parts[-2:])


def test_a_module_name_used_twice_says_why_in_its_docstring():
    """A name two modules share (`kernel.py` in reference/, checks/ and the mutants) is deliberate only
    where each of them names its namesakes in its docstring, saying why; otherwise it is a collision."""
    silent = [f"{path.relative_to(ROOT)} (namesakes: {', '.join(_short(p) for p in paths if p != path)})"
              for paths in namesakes().values() for path in paths
              if not any(_short(p) in _docstring(path) for p in paths if p != path)]
    assert not silent, "modules sharing a name whose docstring names none of its namesakes:\n" + "\n".join(silent)


# ------------------------------------------------------------------ the levels are units
LEVEL_PACKAGE = "harness.levels"
# What the shared code may still ask of a level by its name or case class: at most this many places
# (docs/architecture.md). The levels' own modules and the case classes' file are a level's own code;
# the peers and the mutation catalog name the levels they adapt or break.
OWN = ("harness/levels/", "harness/targets/peers/", "harness/targets/mutants/", "cases/case.py")
MAX_LEVEL_COMPARISONS = 10


def _level_names() -> set[str]:
    from harness.base import levels
    return set(levels.BUILTIN)


def _case_classes() -> set[str]:
    from harness.base import levels
    return {lv.case_class.__name__ for lv in levels.all_levels().values()}


def level_comparisons() -> list[str]:
    """Where shared code compares a level's name (a literal, or a case's `.level`) or tests a case's
    class (`isinstance(c, KernelCase)`): each is a place a new level must edit."""
    names, classes = _level_names(), _case_classes()

    def names_level(n: ast.AST) -> bool:
        if isinstance(n, ast.Constant):
            return n.value in names
        if isinstance(n, (ast.Tuple, ast.List, ast.Set)):
            return any(names_level(e) for e in n.elts)
        return isinstance(n, ast.Attribute) and n.attr == "level"

    def is_case_class(n: ast.AST) -> bool:
        if isinstance(n, ast.Tuple):
            return any(is_case_class(e) for e in n.elts)
        return (isinstance(n, ast.Name) and n.id in classes) or (isinstance(n, ast.Attribute) and n.attr in classes)

    found = []
    for top in ("harness", "cases", "reference"):
        for path in sorted((ROOT / top).rglob("*.py")):  # rglob does not follow harness/cases -> ../cases
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(OWN):
                continue
            for node in _runtime_nodes(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare) and any(names_level(o) for o in (node.left, *node.comparators)):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                        and len(node.args) == 2 and is_case_class(node.args[1]):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_shared_code_asks_the_level_instead_of_comparing_its_name():
    found = level_comparisons()
    assert len(found) <= MAX_LEVEL_COMPARISONS, (
        f"{len(found)} places compare a level's name or case class outside the levels' own modules "
        f"(at most {MAX_LEVEL_COMPARISONS}); ask the case's level (`harness.base.levels.of`) instead:\n"
        + "\n".join(found))


def test_the_comparison_count_sees_a_comparison(monkeypatch, tmp_path):
    """A hand-off by level name in a shared module is counted (a count that cannot rise is no gate)."""
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "shared.py").write_text(
        'def f(case):\n    if case.level == "distill":\n        return 1\n    return isinstance(case, KernelCase)\n')
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert len(level_comparisons()) == 2


def test_shared_code_imports_no_level_module():
    """The levels' modules are a layer of their own: below them nothing imports one (the registry in
    `harness.base.levels` finds them by name), so a new level is added without editing what runs it."""
    importers = sorted(m for m, deps in GRAPH.items() if not m.startswith(LEVEL_PACKAGE) and not in_root(m)
                       and any(d.startswith(LEVEL_PACKAGE + ".") for d in deps))
    assert not importers, f"modules importing a level module: {importers}"
