"""A finding as one stand-alone script for the routine's maintainers: `harness repro --script`.

The script needs torch, the routine's own code and what that code needs (megatron-core), never this
harness. It draws the case's inputs from the case's seed with the case class's own drawing code,
calls the routine as its trainer calls it (a module's own contract function, or a peer adapter's
harness-free call of the peer's files), in this process at TP 1 and over gloo with one
`torch.multiprocessing` process per rank at TP > 1, computes the float64 answer with the harness's
reference functions, and judges with the finding's bounds (the oracle's allowed error per entry,
written out as data) and the harness's comparison. The harness's code travels as its source
(`harness.checks.scripts.embed`): nothing of it is copied into templates here. It exits 1 when the
defect is there, 0 when it is not, 2 when the case could not be run (an import missing, a rank that
never finished).

What a level contributes, its rank-side call and judges, is its `Level.script`
(`harness.checks.scripts.LevelScript`, one module per level in `harness.checks.scripts`); this module
writes any level's script the same way, and holds what every script shares: finding the routine,
running the ranks, the verdict, and the checks that read no output (`crash`, `empty-input`, and
`memory-logits-dtype`, measured with torch's own dispatch mode).

A peer adapter says how its script calls its routine in its declaration
(`Declaration(script={...})`, `harness.targets.declaration`):

    script={"files": {"vp": ("swift/megatron/trainers/vocab_parallel_utils.py",)},
            "kernel": swift_kernel, "megatron": True, "how": "git clone ... && export PYTHONPATH=..."}

`files`: the routine's own source files (each found under an entry of `sys.path`, newest location
first, and loaded alone, as `targets.peers._source` does), passed in that order as the leading
arguments of the call; `kernel` / `linear`: the call, a function of those modules and the
contract's arguments that imports nothing but torch and megatron-core (its source is embedded);
`megatron`: initialise megatron-core's `parallel_state` (the routine takes its group from there);
`how`: how to get the peer's tree. An adapter whose routine is not tensor-parallel
(`capabilities["tensor_parallel"]` False) has TP 1 scripts only: at TP > 1 the harness's gather of
the shards would be in the script, not the peer's code.
"""
from __future__ import annotations

import ast
import inspect
import math
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from harness.base import levels
from harness.cases.case import Case
from harness.checks import oracle, tolerance
from harness.checks.scripts import LevelScript
from harness.checks.scripts.embed import CASE, Script
from harness.checks.terms import alone, loss_terms
from harness.targets import Target, is_file_spec
from harness.targets.declaration import declaration_of

LITERAL_LIMIT = 20_000  # bound entries written into the script; more are saved beside it
HARNESS_PACKAGES = ("harness", "cases", "reference")
MEMORY = "memory-logits-dtype"
RAISING = ("crash", "empty-input")  # the checks whose judge reads the ranks' errors, at every level


@dataclass(frozen=True)
class Recipe:
    """How a script finds and calls the target's routine at one level."""
    files: dict[str, tuple[str, ...]]  # a peer's own files, loaded from the tree on sys.path
    call: Callable[..., Any] | None  # a peer's harness-free call; None: the module's own function
    module: str = ""  # the module to import the routine from
    megatron: bool = False
    how: str = ""
    tensor_parallel: bool = True
    name: str = ""  # whose routine, in the script's title
    where: str = ""  # what the folder on PYTHONPATH holds (the module's file, or its top package), in the instructions


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
        if level not in declared:
            return f"{target.spec}'s declaration has no {level} call for scripts"
        return Recipe(dict(declared.get("files", {})), declared[level], megatron=bool(declared.get("megatron")),
                      how=str(declared.get("how", "")), tensor_parallel=target.supports("tensor_parallel"),
                      name=str(declared.get("name", "")))
    file = getattr(module, "__file__", None)
    if module is None or file is None:
        return f"{target.spec} is not a module this process imported"
    if target.spec.split(".")[0] in HARNESS_PACKAGES or target.spec.startswith("mutant:") or \
            Path(file).resolve().is_relative_to(Path(__file__).resolve().parents[1]):
        return (f"{target.spec} is part of the harness (a script runs without it); its peer adapters declare "
                "Declaration(script=...)")
    if _imports_harness(Path(file)):
        return f"{file} imports the harness itself: a script of it would too"
    top = module.__name__.split(".")[0]
    where = Path(file).name if top == module.__name__ else f"{top}/"  # a package's module: its top package
    return Recipe({}, None, module=module.__name__, where=where, tensor_parallel=target.supports("tensor_parallel"),
                  megatron=_imports_megatron(Path(file)))


def _imports_megatron(path: Path) -> bool:
    """The module imports megatron-core when it is loaded (a routine that takes its group from
    parallel_state at call time says so in its own source: `_reads_megatron`)."""
    tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    return any("megatron" in ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))


def _reads_megatron(fn: Any) -> bool:
    try:
        return "megatron" in inspect.getsource(fn)
    except (OSError, TypeError):  # no source to read: assume it does, as a trainer's process has it
        return True


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
    why = written.refuse(case)
    if why:
        return why
    how = recipe(target, case.level)
    if isinstance(how, str):
        return how
    if case.tp > 1 and not how.tensor_parallel:
        return (f"{target.spec} is not tensor-parallel: at TP {case.tp} the shards are gathered by the harness, "
                "not by the routine; scripts of it run at TP 1")
    return None


def write(target: Target, case: Case, check: str, term: str, path: Path) -> list[Path]:
    """Write the script for `check` (about `term`, "" for every output) on `case` to `path`, and its
    bounds beside it when they are too many to write out; the files written. Raises ValueError with
    the reason when no script can be written (`refusal`)."""
    case = script_case(case, check, term)
    why = refusal(target, case, check)
    if why:
        raise ValueError(why)
    written = level_script(case)
    how = recipe(target, case.level)
    assert written is not None and isinstance(how, Recipe)  # `refusal` said so
    path = Path(path)
    text, saved = _script(target, case, check, term, written, how, path)
    path.write_text(text)
    path.chmod(0o755)
    if saved:
        sidecar = path.with_suffix(".pt")
        torch.save(saved, sidecar)
        return [path, sidecar]
    return [path]


def _script(target: Target, case: Case, check: str, term: str, written: LevelScript, how: Recipe,
            path: Path) -> tuple[str, dict[str, Any]]:
    level = levels.of(case)
    contract = level.contracts[level.key(case)]
    routine = target.routine(level.name, level.key(case))
    megatron = how.megatron or written.parallel_state or (how.call is None and _reads_megatron(routine))
    raising = check in RAISING or check in written.raising
    script = Script({CASE: case, "CHECK": check, "TERM": term, "TP": case.tp, "MEGATRON": megatron,
                     "RAISING": raising})
    script.imports(*IMPORTS)
    judges = {**SHARED_JUDGES, **written.judges}
    script.code(_settings(target, case, check, term, how, contract, megatron, raising), "What this script runs.", 0)
    script.use("compare", tolerance.compare, 3)
    for name, obj in written.uses.items():
        script.use(name, obj, 2)
    level_header = f"The {case.level} level's call and judge."
    script.code(written.code, level_header, 5)
    script.code(judges[check], level_header, 5, replace=True)
    script.code(SHARED_CODE, level_header, 5)
    runner = "Finding the routine, running the ranks, the verdict."
    script.code(_routine(how, contract), runner, 6)
    script.code(RUNNER, runner, 6)
    if how.call is not None:
        script.use(how.call.__name__, how.call, 1)
    reached = {n for d in script.reach(["main"]) for n in _names(d.node)}
    expected = oracle.expected(case) if any(n in reached for n in written.bounds) else None
    data = {n: getattr(expected, field) for n, field in written.bounds.items() if n in reached}
    saved = _bounds(script, data, path)
    head = _head(target, case, check, term, how, contract.name, path.name, _doc(judges[check]), megatron)
    return script.render(["main"], head, "if __name__ == '__main__':\n    sys.exit(main())"), saved


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _doc(code: str) -> str:
    judge = next(n for n in ast.parse(textwrap.dedent(code)).body
                 if isinstance(n, ast.FunctionDef) and n.name == "judge")
    return ast.get_docstring(judge) or ""


def _settings(target: Target, case: Case, check: str, term: str, how: Recipe, contract: Any, megatron: bool,
              raising: bool) -> str:
    takes = tuple(p for p in target.kwargs(case.level, **{k: None for k in contract.keywords})) if how.call is None \
        else tuple(p for p in inspect.signature(how.call).parameters if p in contract.keywords)
    return "\n".join([
        f"CHECK = {check!r}", f"TERM = {term!r}", f"TP = {case.tp}", f"SPEC = {case.spec()!r}",
        f"ROUTINE = {how.module!r}", f"NAME = {contract.name!r}", f"TAKES = {takes!r}",
        f"FILES = { {k: list(v) for k, v in how.files.items()}!r}", f"HOW = {how.how or _where(how)!r}",
        f"MEGATRON = {megatron!r}", f"RAISING = {raising!r}", "RANK_TIMEOUT_S = 120"])


def _where(how: Recipe) -> str:
    return f"put the folder holding {how.where or how.module} on PYTHONPATH, or give the file as the argument"


def _routine(how: Recipe, contract: Any) -> str:
    """`load_routine()`: the routine as the contract calls it, for a module's function or a peer's call."""
    if how.call is None:
        return MODULE_ROUTINE
    params = inspect.signature(how.call).parameters
    taken = ", ".join(p for p in contract.positional if p in params)
    lead = ", ".join(contract.positional)
    return PEER_ROUTINE + f'''

def load_routine():
    """The peer's call of its own files, with the contract's arguments it takes."""
    mods = [load(name, candidates) for name, candidates in FILES.items()]
    return lambda {lead}, **kwargs: {how.call.__name__}(*mods, {taken},
                                                       **{{k: v for k, v in kwargs.items() if k in TAKES}})
'''


def _bounds(script: Script, data: dict[str, Any], path: Path) -> dict[str, Any]:
    """The bounds as script code: written out (four digits, rounded up), or, when they are many,
    saved beside the script and loaded from there; what is to be saved."""
    entries = sum(t.numel() for v in data.values() for t in (v if isinstance(v, list) else [v]) if t is not None)
    header = ("The allowed |error| of each entry, from the harness's float32 error analysis "
              "(logprob-harness's docs/tolerances.md), as data.")
    if entries > LITERAL_LIMIT:
        script.imports("from pathlib import Path")
        script.code(f"BOUNDS = torch.load(Path(__file__).with_name({path.with_suffix('.pt').name!r}))", header, 4)
        for name in data:
            script.code(f"{name} = BOUNDS[{name!r}]", header, 4)
        return data
    script.code(BOUND_DATA, header, 4)
    for name, value in data.items():
        script.code(f"{name} = {_data(value)}", header, 4)
    return {}


def _data(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, list):
        return "[" + ", ".join(_data(v) for v in value) + "]"
    text = " ".join(_up(v) for v in value.detach().reshape(-1).to(torch.float64).tolist())
    lines = textwrap.wrap(text, 96) or [""]
    body = "\n".join(lines) if len(lines) > 1 else lines[0]
    quote = "'''" if len(lines) > 1 else "'"
    return f"_t({quote}{body}{quote}, {tuple(value.shape)!r})"


def _up(v: float) -> str:
    """`v` in four significant digits, never below it (a bound is never made tighter)."""
    if not math.isfinite(v):
        return str(v)
    text = f"{v:.4g}"
    return text if float(text) >= v else f"{math.nextafter(v * (1 + 5e-4), math.inf):.4g}"


def _head(target: Target, case: Case, check: str, term: str, how: Recipe, function: str, name: str,
          about: str, megatron: bool) -> str:
    who = how.name or (how.module.rpartition(".")[2] if how.module else target.spec)
    title = f"{check}{f' ({term} term)' if term else ''} of {who}'s {function}, reproduced with torch and its own code."
    needs = " and megatron-core" if megatron else ""
    run = f"python {name}" if how.call is not None else f"PYTHONPATH=FOLDER python {name}   # or: python {name} FILE.py"
    where = how.how or f"FOLDER holds {how.where or how.module.split('.')[0]}; FILE.py is the routine's file"
    spec = Path(target.spec).name if is_file_spec(target.spec) else target.spec  # no path of this machine
    command = (f"python -m harness repro --target {spec} '{case.spec()}' --check {check}"
               + (f" --term {term}" if term else "") + " --script FILE.py")
    return f'''#!/usr/bin/env python3
"""{title}

{textwrap.fill(" ".join(about.split()), 96)}

The case (logprob-harness's spec): {case.spec()}
Run it in an environment with torch{needs}:

    {run}

{textwrap.fill(where, 96)}
Exit status: 1 the defect is there (its message printed), 0 it is not, 2 the case could not be run.
It needs nothing of the harness. Code under a `# harness/...` line is the harness's own, less its
comments, docstrings, annotations and the branches this case never takes. Written by

    {command}
"""'''


IMPORTS = ("import contextlib", "import importlib", "import importlib.util", "import math", "import os",
           "import socket", "import sys", "import tempfile", "import time", "import traceback", "import weakref",
           "from datetime import timedelta", "from pathlib import Path", "import torch",
           "import torch.distributed as dist", "import torch.multiprocessing as mp",
           "from torch.utils._python_dispatch import TorchDispatchMode", "from torch.utils._pytree import tree_leaves")

BOUND_DATA = '''
def _t(text, shape):
    return torch.tensor([float(v) for v in text.split()], dtype=torch.float64).reshape(shape)
'''

MODULE_ROUTINE = '''
def load_routine():
    """The routine's function: from the module ROUTINE on sys.path (PYTHONPATH), or from the file given
    as the first argument; called with the contract's keyword arguments it takes."""
    try:
        if len(sys.argv) > 1:
            path = Path(sys.argv[1]).resolve()
            sys.path.insert(0, str(path.parent))
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(ROUTINE)
    except (ImportError, OSError) as e:
        sys.exit(f"cannot import the routine ({e}): {HOW}")
    fn = getattr(module, NAME)
    return lambda *args, **kwargs: fn(*args, **{k: v for k, v in kwargs.items() if k in TAKES})
'''

PEER_ROUTINE = '''
def load(name, candidates):
    """A file of the routine's tree, found under an entry of sys.path and loaded alone (its package's
    __init__ may import a whole training stack)."""
    for entry in sys.path:
        for rel in candidates:
            path = Path(entry or ".") / rel
            if path.is_file():
                spec = importlib.util.spec_from_file_location(f"_repro_{name}", path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module
                spec.loader.exec_module(module)
                return module
    sys.exit(f"none of {', '.join(candidates)} under any entry of sys.path: {HOW}")
'''

SHARED_CODE = '''
def detached(t):
    return t.detach().clone() if torch.is_tensor(t) else t


def nonfinite(name, got, want):
    """NaN or inf in `got` where the float64 `want` is finite: how many, and the first."""
    if not torch.is_tensor(got) or want is None or got.numel() != want.numel():
        return []
    got = got.reshape(want.shape)
    bad = torch.isfinite(want) & ~torch.isfinite(got.to(torch.float64))
    if not bad.any():
        return []
    at = tuple(bad.nonzero()[0].tolist())
    return [f"{name}: {int(bad.sum())} non-finite entries where the float64 answer is finite, first at "
            f"{list(at)}: {got[at].item()} (expected {want[at].item():.9g})"]


def errors(results):
    return [f"rank {rank}: {r['error']}" for rank, r in enumerate(results) if "error" in r]
'''

RUNNER = '''
SEEN = {}


class Tally(TorchDispatchMode):
    """The float32 (or float64) tensors the ops allocate (not views of their inputs) that hold all of
    the rank's T x V_local logits entries, and whether one chunk of rows shows (the routine chunks)."""

    def __init__(self):
        super().__init__()
        self.whole, self.chunked = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        rows = {CASE.chunk_size, CASE.T % CASE.chunk_size} - {0}
        for t in tree_leaves(out):
            if not torch.is_tensor(t) or t.untyped_storage().data_ptr() in inputs:
                continue
            shape = tuple(t.shape)
            self.chunked |= CASE.v_local in shape and any(r in shape and t.numel() == r * CASE.v_local for r in rows)
            if t.dtype in (torch.float32, torch.float64) and {CASE.T, CASE.v_local} <= set(shape) and \\
                    t.numel() >= CASE.T * CASE.v_local and not set(shape) & set(EXEMPT):
                self.whole.append((str(func), shape, weakref.ref(t.untyped_storage())))
        return out


@contextlib.contextmanager
def phase(name):
    """Around a rank's forward and its backward: what the memory check reads (nothing for the others)."""
    if CHECK == "memory-logits-dtype":
        with Tally() as tally:
            yield
        whole = [(op, shape, ref() is not None) for op, shape, ref in tally.whole]  # alive: kept past the phase
        SEEN[name] = {"chunked": tally.chunked, "whole": whole}
    else:
        yield


def megatron_group():
    """megatron-core's parallel_state set up as a trainer's process has it; its TP group."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        sys.exit("the routine takes its TP group from megatron-core: pip install megatron-core")
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, create_gloo_process_groups=False)
    except TypeError:  # a megatron-core without that option
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    return parallel_state.get_tensor_model_parallel_group()


def rank_main(rank, port):
    """One TP rank: joins the gloo group, runs the call; what it saw, or its error."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP,
                                timeout=timedelta(seconds=RANK_TIMEOUT_S // 2))
        group = megatron_group() if MEGATRON else dist.group.WORLD
        result = run(load_routine(), rank, group)
        if CHECK == "memory-logits-dtype":
            result["memory"] = SEEN
        return result
    except SystemExit as e:
        return {"setup": str(e)}
    except BaseException as e:  # the routine's failure is the finding's data
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=-6)}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_process(rank, port, out):
    torch.save(rank_main(rank, port), os.path.join(out, f"rank{rank}.pt"))


def ranks(port):
    """Every rank's result: in this process at TP 1, else one spawned process per rank, each stopped
    after RANK_TIMEOUT_S."""
    if TP == 1:
        return [rank_main(0, port)]
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(rank_process, args=(port, out), nprocs=TP, join=False, start_method="spawn")
        deadline = time.monotonic() + RANK_TIMEOUT_S
        try:
            while not ctx.join(timeout=1.0) and time.monotonic() < deadline:
                pass
        except mp.ProcessExitedException as e:
            print(f"a rank died: {e}")
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
        paths = [os.path.join(out, f"rank{rank}.pt") for rank in range(TP)]
        return [torch.load(p, weights_only=False) if os.path.exists(p) else
                {"error": "the rank did not finish (stopped, or it died)"} for p in paths]


def main():
    print(f"case: {SPEC}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = ranks(port)
    setup = [r["setup"] for r in results if "setup" in r]
    if setup:
        print(f"could not run the case: {setup[0]}")
        return 2
    trace = next((r["traceback"] for r in results if "traceback" in r), "")
    if any("error" in r for r in results) and not RAISING:
        print(f"the call raised, so {CHECK} cannot be judged:", *errors(results), trace, sep="\\n  ")
        return 2
    problems = judge(results)
    label = CHECK + (f" ({TERM} term)" if TERM else "")
    if not problems:
        print(f"PASS [{label}]: no defect on this case")
        return 0
    print(f"FINDING [{label}]: " + "; ".join(problems))
    if trace:
        print(trace)
    return 1
'''

SHARED_JUDGES = {
    "crash": '''
def judge(results):
    """Every rank runs the call and its backward without raising (the ranks' errors are the finding)."""
    return errors(results)
''',
    "empty-input": '''
def judge(results):
    """A call on T == 0 rows returns empty outputs, and its backward runs, without raising."""
    return errors(results) + [f"rank {rank}: {key} has {value.numel()} elements for T == 0"
                              for rank, r in enumerate(results) for key, value in r.items()
                              if not key.startswith("grad") and torch.is_tensor(value) and value.numel()]
''',
    MEMORY: '''
def judge(results):
    """NeMo-RL #2872: with bf16 or fp16 logits and a chunk size that splits the rows, a routine that
    works in chunks keeps its float32 work to chunks: its forward makes no float32 copy of all the
    logits that it frees before returning (a whole-tensor .float() in front of the chunks), and its
    backward allocates no float32 buffer of all of them (the gradient belongs in the logits' dtype).
    Measured with torch's dispatch mode: every tensor an op allocates, during the call and during its
    backward."""
    problems = []
    for rank, r in enumerate(results):
        seen = r["memory"]
        if not seen["forward"]["chunked"]:
            continue  # every row at once, by design: the memory budget weighs that, not this check
        whole = (f"all {CASE.T}x{CASE.v_local} logits entries of rank {rank} "
                 f"({CASE.dtype}, chunk_size={CASE.chunk_size})")
        freed = [f"{op} -> {list(shape)}" for op, shape, alive in seen["forward"]["whole"] if not alive]
        if freed:
            problems.append(f"rank {rank}: the forward made a float32 copy of {whole} and freed it before "
                            f"returning: {', '.join(freed)}")
        grown = [f"{op} -> {list(shape)}" for op, shape, _ in seen["backward"]["whole"]]
        if grown:
            problems.append(f"rank {rank}: the backward allocated a float32 buffer of {whole}: {', '.join(grown)}; "
                            "the gradient belongs in the logits' dtype")
    return problems
''',
}
