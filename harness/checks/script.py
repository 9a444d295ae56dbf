"""A finding as one short stand-alone script for the routine's maintainers: `harness repro --script`.

The script is what a maintainer pastes into an issue (at most `MAX_LINES` lines): the case's inputs
drawn from its seed at its shapes, the routine called as its trainer calls it, the float64 reference
of the quantity in question only, one comparison, and a message that says which rank, which rows or
shard, which term, and what was expected. It imports torch, the routine's own code and what that code
needs (megatron-core), never this harness; it finds the routine on `PYTHONPATH` (or as the file given
as its argument), runs in its own process at TP 1 and spawns one process per rank over gloo only at
TP > 1. Exit 1: the defect is there; 0: it is not; 2: it could not run (the routine or
megatron-core not found, or a call that raised where the check judges its outputs).

A level contributes its own code (`Level.script`, a `harness.checks.scripts.LevelScript`): its
inputs, its rank's call and its judges. This module writes the rest: the title, finding the routine,
running the ranks and the verdict, the same at every level.

A peer adapter says how its script calls the peer in its declaration (`Declaration(script={...})`,
`harness.targets.declaration`):

    script={"name": "ms-swift", "files": {"vp": ("swift/megatron/trainers/vocab_parallel_utils.py",)},
            "kernel": swift_kernel, "megatron": True, "how": "git clone ... && export PYTHONPATH=..."}

`files`: the peer's own files (each a path under an entry of `sys.path`, its past locations newest
first, loaded alone; or a dotted module name, imported), passed in that order as the leading
arguments of the call; `kernel` / `wrapper` / `linear` / `distill`: the call at that level, a function
of those modules and the contract's arguments that imports nothing but torch and megatron-core (its
source goes into the script); `megatron`: the routine takes its TP group from megatron-core's
`parallel_state`, which the script initialises; `how`: how to get the peer's tree. An adapter whose
routine no stand-alone script can call says why instead: `script={"none": "..."}`. An adapter whose
routine is not tensor-parallel (`capabilities["tensor_parallel"]` False) gets TP 1 scripts only.
"""
from __future__ import annotations

import ast
import inspect
import re
import shlex
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from harness.base import levels
from harness.cases.case import Case
from harness.checks.scripts import ANY, TALLY, WRONG, LevelScript
from harness.checks.terms import alone, loss_terms
from harness.targets import Target, is_file_spec
from harness.targets.declaration import declaration_of

MAX_LINES = 80
HARNESS_PACKAGES = ("harness", "cases", "reference")
MEMORY = "memory-logits-dtype"
RAISING = ("crash", "empty-input")  # the checks whose judge reads the ranks' errors, at every level


@dataclass(frozen=True)
class Recipe:
    """How a script finds and calls the target's routine at one level."""
    files: dict[str, tuple[str, ...]]  # a peer's own files (or modules), found on sys.path
    call: Callable[..., Any] | None  # a peer's harness-free call; None: the module's own function
    module: str = ""  # the module to import the routine from
    megatron: bool = False
    how: str = ""
    tensor_parallel: bool = True
    name: str = ""  # whose routine, in the script's title
    # Modules a peer's file imports at its top that its call never reaches: stand-ins, each with the
    # names the file imports from it (None, or a script expression its top needs, such as a decorator),
    # so that the file loads where its trainer's package does not.
    stubs: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()


def _imports_harness(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(n.split(".")[0] in HARNESS_PACKAGES for n in names):
            return True
    return False


_recipes: dict[tuple[str, str], Recipe | str] = {}


def recipe(target: Target, level: str) -> Recipe | str:
    """The target's recipe at `level`, or why no script can call it without the harness (once per
    target and level in a process)."""
    key = (target.spec, level)
    if key not in _recipes:
        _recipes[key] = _recipe(target, level)
    return _recipes[key]


def _recipe(target: Target, level: str) -> Recipe | str:
    module = sys.modules.get(target.spec) if not is_file_spec(target.spec) else \
        next((m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == target.spec), None)
    declared = declaration_of(module).script
    if declared is not None:
        if "none" in declared:  # the adapter says why its routine cannot be called without the harness
            return f"{target.spec} declares no script: {declared['none']}"
        if level not in declared:
            return f"{target.spec}'s declaration has no {level} call for scripts"
        files = {k: (v,) if isinstance(v, str) else tuple(v) for k, v in declared.get("files", {}).items()}
        stubs = tuple((m, tuple(names.items()) if isinstance(names, dict) else tuple((n, "None") for n in names))
                      for m, names in declared.get("stubs", {}).items())
        return Recipe(files, declared[level], megatron=bool(declared.get("megatron")), how=str(declared.get("how", "")),
                      stubs=stubs,
                      tensor_parallel=target.supports("tensor_parallel"), name=str(declared.get("name", "")))
    file = getattr(module, "__file__", None)
    if module is None or file is None:
        return f"{target.spec} is not a module this process imported"
    if target.spec.split(".")[0] in HARNESS_PACKAGES or target.spec.startswith("mutant:") or \
            Path(file).resolve().is_relative_to(Path(__file__).resolve().parents[1]):
        return (f"{target.spec} is part of the harness (a script runs without it); its peer adapters declare "
                "Declaration(script=...)")
    if _imports_harness(Path(file)):
        return f"{file} imports the harness itself: a script of it would too"
    return Recipe({}, None, module=module.__name__, tensor_parallel=target.supports("tensor_parallel"))


def level_script(case: Case) -> LevelScript | None:
    """The case's level's script writer (`Level.script`), or None where the level has none."""
    found = levels.of(case).script
    return found if isinstance(found, LevelScript) else None


def script_case(case: Case, check: str, term: str) -> Case:
    """The case the script runs: a finding about one term's gradient, with both terms in the loss,
    runs with that term alone (its own defect, not the other's)."""
    written = level_script(case)
    if written is not None and check in written.alone and term and len(loss_terms(case)) > 1 and term in alone(case):
        return alone(case)[term]
    return case


def refusal(target: Target, case: Case, check: str) -> str | None:
    """Why no script can be written for `check` on `case`, or None."""
    written = level_script(case)
    if written is None:
        return f"the {case.level} level writes no scripts"
    if check not in written.checks:
        return f"scripts are written for the checks {', '.join(written.checks)} at the {case.level} level"
    if case.context != "train":
        return f"scripts run the training path (one call); this case's context is {case.context}"
    if getattr(case, "dp", 1) > 1:
        return "scripts run one TP group (dp=1)"
    if check == MEMORY and getattr(case, "dtype", "fp32") == "fp32":
        return f"{MEMORY} is about half-precision logits: a float32 copy of float32 ones is no finding"
    why = written.refuse(case)
    if why:
        return why
    how = recipe(target, case.level)
    if isinstance(how, str):
        return how
    if case.tp > 1 and not how.tensor_parallel:
        return (f"{target.spec} is not tensor-parallel: at TP {case.tp} the shards are gathered by the harness, "
                "not by the routine; scripts of it run at TP 1")
    if how.call is not None:  # a peer's declared call: it must take every input the case hands over
        params = inspect.signature(how.call).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            lacking = [k for k in written.required(case) if k not in params]
            if lacking:
                return f"{target.spec}'s script call takes no {', '.join(lacking)} (this case hands them over)"
    return None


def write(target: Target, case: Case, check: str, term: str, path: Path) -> list[Path]:
    """Write the script for `check` (about `term`, "" for every output) on `case` to `path`; the files
    written. Raises ValueError with the reason when no script can be written (`refusal`). The case is
    the one the run checked: fitted to what the target declares it takes, as the repro line of a
    finding prints it, whether given that way or not."""
    case = script_case(levels.fit(case, target.supports), check, term)
    why = refusal(target, case, check)
    if why:
        raise ValueError(why)
    written = level_script(case)
    how = recipe(target, case.level)
    assert written is not None and isinstance(how, Recipe)  # `refusal` said so
    path = Path(path)
    path.write_text(render(target, case, check, term, written, how, path.name))
    return [path]


def render(target: Target, case: Case, check: str, term: str, written: LevelScript, how: Recipe, name: str) -> str:
    """The script's text."""
    level = levels.of(case)
    contract = level.contracts[level.key(case)]
    memory = check == MEMORY
    parts = written.write(case, check, term, memory)
    fn = how.call if how.call is not None else target.routine(level.name, level.key(case))
    megatron = how.megatron or written.parallel_state or (how.call is None and _reads_megatron(fn))
    raising = check in RAISING or check in written.raising
    run = parts.run.replace("CALL", _call(fn, len(how.files) if how.call is not None else 0, contract, parts.args))
    exempt = f" and not set(t.shape) & {set(written.exempt(case))}" if written.exempt(case) else ""
    judge = TALLY.replace("EXEMPT", exempt) if memory else parts.judge
    constants = {"TP": case.tp, "T": case.T, "V_LOCAL": case.v_local, "V": case.tp * case.v_local, "SEED": case.seed}
    extra = {**parts.constants, **({"DTYPE": case.dtype, "CHUNK": case.chunk_size}
                                   if memory else {})}
    used = run + judge + parts.inputs  # a level's constant is written where its code reads it
    read = {k: v for k, v in extra.items() if re.search(rf"\b{k}\b", used)}
    # Sections apart by a blank line; the functions of one section (finding the routine, judging,
    # running the ranks) one after the other.
    sections = [[_loader(how, contract.name, target), *([_source(how.call)] if how.call is not None else [])],
                [parts.inputs, run], [judge, *([WRONG] if "off(" in judge else [])],
                [_runner(case.tp, megatron, check, raising), "if __name__ == '__main__': sys.exit(main())"]]
    text = "\n\n".join("\n".join(_tight(b) for block in section for b in re.split(r"\n[ \t]*\n[ \t]*\n", block.strip("\n")))
                       for section in sections)
    # The shared constants too, where the script reads them (a level without a vocabulary reads no V).
    shared = {k: v for k, v in constants.items() if re.search(rf"\b{k}\b", text)}
    settings = "\n".join(f"{', '.join(names)} = {', '.join(map(repr, names.values()))}" for names in (shared, read) if names)
    head = _head(target, case, check, term, how, contract.name, name, parts.about, megatron)
    return f"{head}\n{_imports(settings + text)}\n{settings}\n\n{text}\n"


def _tight(block: str) -> str:
    """One top-level statement of the script, without its blank lines, a function's one-line docstring
    a comment on its `def` line."""
    lines = [line for line in block.strip("\n").splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith(("def ", "class ")) and lines[0].endswith(":") and \
            re.fullmatch(r'    """[^"]+"""', lines[1]):
        lines[:2] = [f"{lines[0]}  # {lines[1].strip()[3:-3]}"]
    return "\n".join(lines)


def _reads_megatron(fn: Any) -> bool:
    """The routine takes its group from megatron-core's parallel_state at call time (its source says so)."""
    try:
        return "parallel_state" in inspect.getsource(fn)
    except (OSError, TypeError):  # no source to read: assume it does, as a trainer's process has it
        return True


def _call(fn: Any, lead: int, contract: Any, args: dict[str, tuple[str, Any]]) -> str:
    """`fn(...)` with the contract's arguments as the routine takes them: the positional ones it has
    by position, the keywords it has by name, less those at its own default."""
    params = list(inspect.signature(fn).parameters.values())[lead:]
    named = {p.name: p for p in params}
    every = any(p.kind is p.VAR_KEYWORD for p in params)
    out = []
    for key, (expr, value) in args.items():
        p = named.get(key)
        if p is None and not every:
            continue
        if key in contract.positional and not contract.keyword_only and p is not None and p.kind is not p.KEYWORD_ONLY:
            out.append(expr)
        elif value is ANY or p is None or p.default is p.empty or p.default != value:
            out.append(f"{key}={expr}")
    return f"fn({', '.join(out)})"


# The script's imports, each where its text uses it: the standard library's, then torch's, on one line.
IMPORTS = {"argparse": "argparse", "datetime": "datetime", "functools": "functools", "importlib.import_module": "importlib",
           "importlib.util": "importlib.util", "itertools.": "itertools", "math.": "math", "os.": "os", "sys.": "sys", "tempfile": "tempfile",
           "traceback": "traceback", "types.": "types", "weakref": "weakref"}
TORCH = {"torch": "torch", "dist.": "torch.distributed as dist", "mp.": "torch.multiprocessing as mp"}
FROM = {"TorchDispatchMode": "torch.utils._python_dispatch", "tree_leaves": "torch.utils._pytree",
        "FlopCounterMode": "torch.utils.flop_counter"}


def _imports(text: str) -> str:
    modules = [m for table in (IMPORTS, TORCH) for name, m in table.items() if name in text]
    lines = ["import " + ", ".join(modules), *(f"from {m} import {name}" for name, m in FROM.items() if name in text)]
    return "\n".join(lines)


def _loader(how: Recipe, name: str, target: Target) -> str:
    """`routine()`: the function the script calls, found on PYTHONPATH (ImportError when it is not)."""
    if how.call is None:
        module = Path(target.spec).stem if is_file_spec(target.spec) else how.module
        return f'''def routine():  # {name} of the module {module} on PYTHONPATH, or of the file given as the argument
    where = sys.argv[1] if len(sys.argv) > 1 else {module!r}
    if where.endswith(".py"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
    return importlib.import_module(os.path.basename(where).removesuffix(".py")).{name}'''
    assert how.call is not None
    loads = ", ".join(f"load{tuple(v)!r}".replace(",)", ")") if v[0].endswith(".py") else
                      f"importlib.import_module({v[0]!r})" for v in how.files.values())
    stubs = "".join(f"""
    sys.modules.setdefault({m!r}, types.SimpleNamespace({', '.join(f'{n}={v}' for n, v in names)}))  # imported at its top"""
                    for m, names in how.stubs)
    load = f'''def load(*where):  # a file of the trainer's tree (at any past place) under an entry of PYTHONPATH, alone{stubs}
    path = next((p for p in (os.path.join(r or ".", w) for r in sys.path for w in where) if os.path.isfile(p)), where[0])
    spec = importlib.util.spec_from_file_location(where[0][:-3].replace("/", "."), path)
    spec.loader.exec_module(module := importlib.util.module_from_spec(spec))  # OSError where the tree is not
    return sys.modules.__setitem__(spec.name, module) or module  # by its module name: a later file imports it


''' if "load(" in loads else ""
    return load + f'''def routine():  # {how.name or "the trainer"}'s call of its own code, as its trainer makes it
    return functools.partial({how.call.__name__}, {loads})'''


def _source(fn: Callable[..., Any]) -> str:
    """A peer's call as its source, less its docstring."""
    source = textwrap.dedent(inspect.getsource(fn))
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef)
    lines = source.splitlines()
    if ast.get_docstring(node) is not None:
        first = node.body[0]
        del lines[first.lineno - 1:first.end_lineno]
    return "\n".join(lines)


def _runner(tp: int, megatron: bool, check: str, raising: bool) -> str:
    spawn = "mp.spawn(rank_main, args=(out,), nprocs=TP)" if tp > 1 else "rank_main(0, out)  # TP 1: in this process"
    group = ("    from megatron.core import parallel_state as mpu  # the routine's TP group, set up as its trainer does\n"
             "    mpu.initialize_model_parallel(tensor_model_parallel_size=TP)\n") if megatron else ""
    verdict = 'problems = [r["error"] for r in results if "error" in r] or list(judge(results))' if raising else \
        f'if errors := [r["error"] for r in results if "error" in r]:\n        return print("could not judge {check}: " + "; ".join(errors)) or 2\n    problems = list(judge(results))'
    return f'''def rank_main(rank, out):  # one TP rank over gloo: what its call returned, or where it raised
    dist.init_process_group("gloo", init_method=f"file://{{out}}/store", rank=rank, world_size=TP, timeout=datetime.timedelta(seconds=60))
{group}    try:
        result = run(routine(), rank, {"mpu.get_tensor_model_parallel_group()" if megatron else "dist.group.WORLD"})
    except Exception as e:  # the routine's failure is the finding's data
        result = {{"error": f"rank {{rank}}'s {{'backward' if 'backward' in (traceback.extract_tb(e.__traceback__)[1].line or '') else 'call'}} raised {{type(e).__name__}}: {{e}}"}}
    torch.save(result, f"{{out}}/{{rank}}.pt")
    dist.destroy_process_group()  # gloo's threads joined now: left to the interpreter's exit, one may abort it


def main():
    try:
        routine()
    except (ImportError, OSError) as e:
        return print(f"could not run: {{e}}\\n{{__doc__}}") or 2
    with tempfile.TemporaryDirectory() as out:
        {spawn}
        results = [torch.load(f"{{out}}/{{r}}.pt", weights_only=False) for r in range(TP)]
    {verdict}
    return print("\\n".join(f"DEFECT ({check}): {{p}}" for p in problems) or "no defect ({check})") or int(bool(problems))'''


def _head(target: Target, case: Case, check: str, term: str, how: Recipe, function: str, name: str,
          about: str, megatron: bool) -> str:
    who = how.name or (how.module.rpartition(".")[2] if how.module else Path(target.spec).stem)
    spec = Path(target.spec).name if is_file_spec(target.spec) else target.spec  # no path of this machine
    command = (f"python -m harness repro --target {spec} {shlex.quote(case.spec())} --check {check}"
               + (f" --term {term}" if term else "") + f" --script {name}")
    if how.call is not None:
        run = f"PYTHONPATH=TREE python {name}" + (f", TREE got by: {how.how}" if how.how else "")
    else:
        file = Path(spec).stem if is_file_spec(spec) else how.module.split(".")[-1]
        run = f"PYTHONPATH=FOLDER python {name} (FOLDER holds the routine's module), or: python {name} path/to/{file}.py"
    needs = "torch and megatron-core" if megatron else "torch"
    return (f'"""{who}\'s {function}: {about}. Needs {needs}.\n'
            f"Run: {run}. Exit 1: the defect is there; 0: it is not; 2: could not run. Written by: {command}\"\"\"")
