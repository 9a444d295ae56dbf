"""The package's imports run one way: no module of `harness` imports, directly or through others,
a module that imports it back, and no layer imports a layer above it. Every import counts, at module
level or inside a function; only `if TYPE_CHECKING:` blocks are exempt (they never run)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "harness"

# Low to high. A module may import its own layer or a lower one. The engine has a rank side (what
# runs in the workers) below the checks, and a driver side (runner, explorer) above them.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("harness.base.errors", "harness.meters"),
    ("harness.base.observations", "harness.targets"),
    ("harness.targets.mutants", "harness.base.options"),
    ("harness.engine.calls", "harness.engine.executor", "harness.engine.progress", "harness.engine.stacks",
     "harness.engine.wire", "harness.driver.pool",
     "harness.driver.torchrun", "harness.perf.jobs", "harness.perf.callgrind"),
    ("harness.checks", "harness.checks.findings", "harness.checks.known"),
    ("harness.driver.runner", "harness.driver.limits", "harness.driver.explorer"),
    ("harness.perf.gate", "harness.report"),
    ("harness.commands.mutate", "harness.commands.peers", "harness.commands.history"),
    ("harness.cli", "harness.plugin", "harness.__main__", "harness.conformance"),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py"}  # the root is empty


def layer(module: str) -> int:
    best, depth = None, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > depth:
                best, depth = i, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


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


def test_every_module_has_a_layer():
    for m in MODULES:
        if MODULES[m].name == "__init__.py" and not GRAPH[m]:
            continue  # a package's docstring: it imports nothing, so it has no place to keep
        layer(m)


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
