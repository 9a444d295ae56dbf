"""The code of a stand-alone script as a closure: the definitions its `main` reaches, no more.

A script is assembled from two kinds of code. Its own (a level's rank call and judge, the shared
runner) is given as text. The harness's (a case's input drawing, the float64 reference, the
comparison) is given as the objects themselves and taken from their source with `inspect`, with
every name they use resolved in their own module and brought along the same way: functions and
constants as they are written there, a dataclass as a namedtuple of its fields (a script reads its
fields only), a harness module's attribute (`kernel.log_probs`) as the plain name, torch and the
standard library as imports. So the script runs the harness's code, not a copy kept in strings.

Before it is written, each definition is fitted to its case: docstrings, comments and annotations
are left out, and an `if` whose test reads only what is known when the script is written (the case's
fields, the check, the TP size, a module's constant) keeps only the branch it takes, so a script
shows the path its case runs and nothing else. The case is `CASE` in script code and `self` in a
method of its class; the fields that remain read are written out as `CASE`'s attributes.
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import math
import sys
import textwrap
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Iterable

PLAIN = (bool, int, float, str, type(None))
HARNESS = ("harness.", "cases.", "reference.")  # the packages whose code is brought along, not imported
CASE = "CASE"


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(_plain(v) for v in value)
    return isinstance(value, PLAIN)


def _is_harness(module_name: str) -> bool:
    return module_name.startswith(HARNESS)


@functools.lru_cache(maxsize=None)
def _module_tree(name: str) -> dict[str, ast.stmt]:
    """A module's top-level definitions by the names they bind (the last binding wins)."""
    module = sys.modules[name]
    tree = ast.parse(inspect.getsource(module))
    found: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        found[n.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            found[node.target.id] = node
    return found


def _constants(module: ModuleType | None) -> dict[str, Any]:
    """A module's plain constants: what a pruned test may read besides the known values."""
    if module is None:
        return {}
    return {k: v for k, v in vars(module).items() if not k.startswith("__") and _plain(v)}


def decide(test: ast.expr, env: dict[str, Any]) -> bool | None:
    """The truth of `test` when it reads only names of `env` and calls nothing, else None."""
    if isinstance(test, ast.BoolOp):
        parts = [decide(v, env) for v in test.values]
        stop = isinstance(test.op, ast.Or)  # the value that settles the whole: True for `or`, False for `and`
        if stop in parts:
            return stop
        return None if None in parts else not stop
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = decide(test.operand, env)
        return None if inner is None else not inner
    nodes = list(ast.walk(test))
    if any(isinstance(n, (ast.Call, ast.Lambda, ast.NamedExpr, ast.Subscript)) for n in nodes):
        return None
    if not {n.id for n in nodes if isinstance(n, ast.Name)} <= env.keys():
        return None
    try:
        value = eval(compile(ast.Expression(test), "<prune>", "eval"), {"__builtins__": {}}, dict(env))
    except Exception:  # a test this case cannot evaluate yet: keep both branches
        return None
    return bool(value) if _plain(value) else None


class _Fit(ast.NodeTransformer):
    """Prunes the branches `env` decides; in harness code (`strip`) also drops docstrings and annotations."""

    def __init__(self, env: dict[str, Any], strip: bool):
        self.env, self.strip = env, strip

    def _stmts(self, body: list[ast.stmt]) -> list[ast.stmt]:
        """The statements kept, none after one that leaves the block (a decided branch's `return`)."""
        out: list[ast.stmt] = []
        for stmt in body:
            kept = self.visit(stmt)
            out.extend(kept if isinstance(kept, list) else [kept] if kept is not None else [])
            if out and isinstance(out[-1], (ast.Return, ast.Raise, ast.Break, ast.Continue)):
                break
        return out

    def _body(self, body: list[ast.stmt]) -> list[ast.stmt]:
        if self.strip and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]
        return self._stmts(body) or [ast.Pass()]

    def generic_visit(self, node: ast.AST) -> ast.AST:
        node = super().generic_visit(node)
        if isinstance(getattr(node, "body", None), list) and not node.body:  # type: ignore[attr-defined]
            node.body = [ast.Pass()]  # type: ignore[attr-defined]
        return node

    def _test(self, test: ast.expr) -> ast.expr:
        """An undecided test less its decided parts (a true operand of `and`, a false one of `or`):
        in a test only its truth counts."""
        if isinstance(test, ast.BoolOp):
            settled = isinstance(test.op, ast.And)  # the operand value that decides nothing
            kept = [self._test(v) for v in test.values if decide(v, self.env) is not settled]
            return kept[0] if len(kept) == 1 else ast.BoolOp(op=test.op, values=kept)
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return ast.UnaryOp(op=test.op, operand=self._test(test.operand))
        return self.visit(test)

    def visit_If(self, node: ast.If) -> Any:
        taken = decide(node.test, self.env)
        if taken is None:
            node.test = self._test(node.test)
            node.body = self._stmts(node.body) or [ast.Pass()]
            node.orelse = self._stmts(node.orelse)
            return node
        return self._stmts(node.body if taken else node.orelse)

    def visit_IfExp(self, node: ast.IfExp) -> Any:
        taken = decide(node.test, self.env)
        if taken is None:
            node.test = self._test(node.test)
            node.body, node.orelse = self.visit(node.body), self.visit(node.orelse)
            return node
        return self.visit(node.body if taken else node.orelse)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> Any:
        if self.strip:
            node.returns = None
            args = node.args
            for a in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg):
                if a is not None:
                    a.annotation = None
        node.decorator_list = [self.visit(d) for d in node.decorator_list]
        node.args = self.visit(node.args)
        node.body = self._body(node.body)
        return node

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> Any:
        node.decorator_list = [self.visit(d) for d in node.decorator_list]
        node.body = self._body(node.body)
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> Any:
        if not self.strip:
            return self.generic_visit(node)
        if node.value is None:
            return None
        return ast.copy_location(ast.Assign(targets=[node.target], value=self.visit(node.value)), node)


@dataclass
class _Def:
    name: str
    node: ast.stmt
    group: tuple[int, str]  # (rank, header): where the definition is listed
    module: ModuleType | None  # where its free names resolve (None: the script's own code)
    self_is_case: bool = False  # a method of the case's class: its `self` is CASE
    inlined: list[tuple[str, str]] = field(default_factory=list)  # (module, name) of `module.name` reads made plain
    fitted: bool = False


def _free_names(node: ast.AST) -> list[str]:
    """The names `node` reads, in order of appearance (its locals too: those resolve to nothing)."""
    seen: dict[str, None] = {}
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            seen.setdefault(n.id, None)
    return list(seen)


def _locals(node: ast.AST) -> set[str]:
    """The names a definition binds inside itself (parameters, assignments, loop variables)."""
    bound = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    return bound | {a.arg for n in ast.walk(node) if isinstance(n, ast.arguments)
                    for a in (*n.posonlyargs, *n.args, *n.kwonlyargs, n.vararg, n.kwarg) if a is not None}


def _load_time_names(node: ast.stmt) -> set[str]:
    """The names a definition reads when the script is loaded (not those inside function bodies)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        parts: list[Any] = [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]
    elif isinstance(node, ast.ClassDef):
        parts = [*node.decorator_list, *node.bases]
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                parts += [*stmt.decorator_list, *stmt.args.defaults]
            else:
                parts.append(stmt)
    else:
        parts = [node]
    return {name for p in parts if p is not None for name in _free_names(p)}


def _header(module: ModuleType) -> str:
    doc = (inspect.getdoc(module) or "").strip().split("\n\n")[0].replace("\n", " ")
    path = module.__name__.replace(".", "/") + ".py"
    return f"{path}: {doc}" if doc else path


def _literal(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    return repr(value)


class _Inline(ast.NodeTransformer):
    """`module.name` -> `name` for the harness modules a definition's module imports, noting each pair."""

    def __init__(self, module: ModuleType):
        self.module, self.pairs = module, []
        self.modules = {k for k, v in vars(module).items() if inspect.ismodule(v) and _is_harness(v.__name__)}

    def visit_Attribute(self, node: ast.Attribute) -> Any:
        if isinstance(node.value, ast.Name) and node.value.id in self.modules:
            self.pairs.append((vars(self.module)[node.value.id].__name__, node.attr))
            return ast.copy_location(ast.Name(id=node.attr, ctx=node.ctx), node)
        return self.generic_visit(node)


@dataclass
class Script:
    """The definitions a script may hold; `render` writes those its roots reach.

    `known`: the values a pruned test of script code may read (`CASE` the case, the check, the TP
    size, ...)."""
    known: dict[str, Any]
    _defs: dict[str, _Def] = field(default_factory=dict)
    _origin: dict[str, Any] = field(default_factory=dict)  # name -> what it was made from
    _uses: dict[str, tuple[Any, int]] = field(default_factory=dict)
    _imports: dict[str, set[str]] = field(default_factory=dict)  # name -> the import lines that bind it

    def code(self, text: str, header: str, rank: int, replace: bool = False) -> None:
        """Script code: each top-level statement defines the one name it binds, listed under `header`
        (`replace`: in place of an earlier definition of that name)."""
        for node in ast.parse(textwrap.dedent(text)).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = node.name
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
            else:
                raise ValueError(f"script code binds one name per statement: {ast.unparse(node)[:80]}")
            if replace:
                self._defs.pop(name, None)
            self._add(_Def(name, node, (rank, header), None), ("script", name, ast.dump(node)))

    def use(self, name: str, obj: Any, rank: int) -> None:
        """A harness object that script code reads as `name`, brought along where it is reached."""
        self._uses[name] = (obj, rank)

    def imports(self, *lines: str) -> None:
        """Import lines a script may need; each is written where a name it binds is read."""
        for line in lines:
            stmt = ast.parse(line).body[0]
            assert isinstance(stmt, (ast.Import, ast.ImportFrom))
            for alias in stmt.names:
                self._imports.setdefault((alias.asname or alias.name).split(".")[0], set()).add(line)

    def _add(self, d: _Def, origin: Any) -> _Def:
        if d.name in self._defs:
            if self._origin[d.name] != origin:
                raise ValueError(f"two definitions of {d.name!r} in one script")
            return self._defs[d.name]
        self._defs[d.name], self._origin[d.name] = d, origin
        return d

    # ------------------------------------------------------------------ the harness's code
    def _bring(self, name: str, obj: Any, rank: int, module: ModuleType | None) -> _Def | None:
        """The definition of `obj` under `name` (read in `module`, None for a use): harness code
        brought along, or None where an import binds it."""
        obj = inspect.unwrap(obj) if callable(obj) and hasattr(obj, "__wrapped__") else obj
        if self._origin.get(name) is obj:
            return self._defs[name]
        if inspect.ismodule(obj):
            if _is_harness(obj.__name__):
                raise ValueError(f"{name}, the harness module {obj.__name__}, is read as a whole")
            self.imports(f"import {obj.__name__}" if obj.__name__ == name else f"import {obj.__name__} as {name}")
            return None
        owner = getattr(obj, "__module__", None) or ""
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and _is_harness(owner):
            home = sys.modules[owner]
            if dataclasses.is_dataclass(obj):
                return self._add(_Def(name, self._namedtuple(name, obj), (rank, _header(home)), home), obj)
            node = ast.parse(textwrap.dedent(inspect.getsource(obj))).body[0]
            assert isinstance(node, (ast.FunctionDef, ast.ClassDef))
            node.name = name
            if isinstance(node, ast.FunctionDef):
                node.decorator_list = []  # a cache or a registration: the script calls the function itself
            cls = vars(home).get(obj.__qualname__.split(".")[0]) if "." in obj.__qualname__ else None
            of_case = isinstance(cls, type) and isinstance(self.known.get(CASE), cls)
            return self._add(_Def(name, node, (rank, _header(home)), home, self_is_case=of_case), obj)
        if module is not None and not (inspect.isfunction(obj) or inspect.isclass(obj)):
            return self._constant(name, module, rank)
        if owner and getattr(sys.modules.get(owner), name, None) is obj:
            self.imports(f"from {owner} import {name}")
            return None
        raise ValueError(f"cannot bring {name!r} ({type(obj).__name__}) into a script")

    def _namedtuple(self, name: str, cls: type) -> ast.stmt:
        fields = dataclasses.fields(cls)
        defaults = [f.default for f in fields if f.default is not dataclasses.MISSING]
        if not all(_plain(d) for d in defaults) or any(f.default_factory is not dataclasses.MISSING for f in fields):
            raise ValueError(f"{name}'s defaults cannot be written into a script")
        self.imports("from collections import namedtuple")
        tail = f", defaults={tuple(defaults)!r}" if defaults else ""
        return ast.parse(f"{name} = namedtuple({name!r}, {[f.name for f in fields]!r}{tail})").body[0]

    def _constant(self, name: str, module: ModuleType, rank: int) -> _Def:
        """A module's constant as its assignment there (a plain value as a literal where the module
        binds it otherwise: an import, an unpacking)."""
        if self._origin.get(name) == ("constant", module.__name__, name):
            return self._defs[name]
        node = _module_tree(module.__name__).get(name)
        value = vars(module)[name]
        single = isinstance(node, ast.AnnAssign) or (isinstance(node, ast.Assign) and len(node.targets) == 1
                                                      and isinstance(node.targets[0], ast.Name))
        if node is None or not single:
            if not _plain(value):
                raise ValueError(f"cannot bring {module.__name__}.{name} into a script")
            node = ast.parse(f"{name} = {_literal(value)}").body[0]
        node = copy.deepcopy(node)  # fitted in place: the module's parsed tree serves every script
        return self._add(_Def(name, node, (rank, _header(module)), module), ("constant", module.__name__, name))

    def _resolve(self, name: str, where: _Def) -> _Def | None:
        """The definition `name` refers to where `where` reads it; None for a local, a builtin or an import."""
        if where.module is None:
            if name in self._defs:
                return self._defs[name]
            if name not in self._uses:
                return None
            obj, rank = self._uses[name]
            return self._bring(name, obj, rank, None)
        if name not in vars(where.module):
            return None
        return self._from_module(name, where.module, where.group[0])

    def _from_module(self, name: str, module: ModuleType, rank: int) -> _Def | None:
        """A harness module's global: its assignment there, or the object it binds brought along."""
        if isinstance(_module_tree(module.__name__).get(name), (ast.Assign, ast.AnnAssign)):
            return self._constant(name, module, rank)
        return self._bring(name, vars(module)[name], rank, module)

    def _fit(self, d: _Def) -> None:
        """Prune `d` to its case; in harness code, also make its harness-module reads plain names (once)."""
        if d.fitted:
            return
        d.fitted = True
        if d.module is None:
            env = dict(self.known)
        else:
            inline = _Inline(d.module)
            d.node = inline.visit(d.node)
            d.inlined = inline.pairs
            env = {**_constants(d.module), **({"self": self.known[CASE]} if d.self_is_case else {})}
        for name in _locals(d.node) - ({"self"} if d.self_is_case else set()):
            env.pop(name, None)
        d.node = ast.fix_missing_locations(_Fit(env, strip=d.module is not None).visit(d.node))

    def reach(self, roots: Iterable[str]) -> list[_Def]:
        """The definitions the roots reach, each fitted, in the order they were reached."""
        order: list[_Def] = []
        done: set[str] = set()
        todo = [(name, None) for name in roots]
        while todo:
            name, where = todo.pop(0)
            if name in done and (where is None or where.module is None):
                continue
            d = self._defs.get(name) if where is None else self._resolve(name, where)  # a clash raises here
            if d is None or name in done:
                continue
            done.add(name)
            self._fit(d)
            order.append(d)
            local = _locals(d.node)
            todo += [(n, d) for n in _free_names(d.node) if n not in done and n not in local]
            for module_name, attr in d.inlined:
                if attr not in done and self._from_module(attr, sys.modules[module_name], d.group[0]) is not None:
                    todo.append((attr, None))
        return order

    def case_fields(self, order: list[_Def]) -> dict[str, Any]:
        """The case's fields the reached code reads (`CASE.x`, and `self.x` in its class's methods)."""
        names: dict[str, None] = {}
        for d in order:
            for n in ast.walk(d.node):
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and \
                        (n.value.id == CASE or (d.self_is_case and n.value.id == "self")):
                    names.setdefault(n.attr, None)
        case = self.known[CASE]
        values = {k: getattr(case, k) for k in names}
        odd = [k for k, v in values.items() if not _plain(v)]
        if odd:
            raise ValueError(f"the script would read the case's {', '.join(odd)}, which are not plain values")
        return values

    def render(self, roots: Iterable[str], head: str, tail: str) -> str:
        """`head`, the imports, the definitions the roots reach under their headers (each placed after
        what it reads when the script loads), then `tail`."""
        order = self.reach(roots)
        fields = self.case_fields(order)
        if fields:
            self.imports("from types import SimpleNamespace")
            body = ", ".join(f"{k}={_literal(v)}" for k, v in sorted(fields.items()))
            node = ast.parse(f"{CASE} = SimpleNamespace({body})").body[0]
            order.insert(0, self._add(_Def(CASE, node, (-1, "The case: the fields this script reads."), None),
                                      ("case",)))
        used = {n for d in order for n in _free_names(d.node)} | set(_free_names(ast.parse(tail)))
        imports = sorted({line for name, lines in self._imports.items() if name in used for line in lines},
                         key=lambda line: (line.startswith("from"), line))
        parts = [head.rstrip() + "\n", "\n".join(imports) + "\n"]
        header = None
        ranked = sorted(order, key=lambda d: (d.group[0], list(self._defs).index(d.name)))
        for d in _load_order(ranked):
            if d.group[1] != header:
                header = d.group[1]
                parts.append("\n" + textwrap.fill(header, 100, initial_indent="# ", subsequent_indent="# ") + "\n")
            elif isinstance(d.node, (ast.FunctionDef, ast.ClassDef)):
                parts.append("\n")
            parts.append(ast.unparse(d.node) + "\n")
        return "".join(parts) + "\n" + tail.strip() + "\n"


def _load_order(defs: list[_Def]) -> list[_Def]:
    """`defs` with each one's load-time reads (a constant another constant or a class reads) placed
    before it, and the rest kept in order, a group's definitions together where that allows."""
    by_name = {d.name: d for d in defs}
    out: list[_Def] = []
    placed: set[str] = set()

    def place(d: _Def, path: tuple[str, ...]) -> None:
        if d.name in placed or d.name in path:
            return
        for n in sorted(_load_time_names(d.node)):
            if n in by_name and n != d.name:
                place(by_name[n], path + (d.name,))
        placed.add(d.name)
        out.append(d)

    groups: dict[tuple[int, str], list[_Def]] = {}
    for d in defs:
        groups.setdefault(d.group, []).append(d)
    for members in groups.values():
        for d in members:
            place(d, ())
    return out
