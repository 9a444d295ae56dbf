"""The docs describe the product as it is: every relative link resolves, every count they state
equals its registry's, and no page or source line speaks of how the project was built (the past
lives in git)."""
from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
SOURCE_DIRS = ("harness", "cases", "reference", "tests", "scripts", "benchmarks")
SOURCE_SUFFIXES = {".py", ".j2", ".toml", ".cpp", ".ini"}
SOURCE_FILES = ("conftest.py", "pyproject.toml", "tox.ini", ".ci/run")

# Pages being rewritten on other lines of work, exempt from the process-word and count checks
# until they land (their links are checked).
REWRITTEN_ELSEWHERE: set[str] = set()

# Words of how the project was built, meaningless to a user; each with what it looks like.
# Peers' numbered issues and PRs ("slime #2153") are facts about the field and are not matched.
PROCESS = {
    "a work stop": r"\bstops? \d+\b",
    "an issue of ours": r"\bissues? \d+\b",
    "a branch of ours": r"\b(this|our) branch\b|\bmain vs (this|ours)\b",
    "a change of ours": r"\b(before|after|since) (this|the last|the previous) (change|commit|work|fix)\b"
                        r"|\bprevious commit\b|\bbefore this work\b",
    "a machine path": r"(?<![\w.~])/(work|home|Users|root|mnt|tmp/[a-z]+-)/?",
}
# In prose only: the docs say what the product is, not what it was or has become. A line that cites
# a peer's numbered PR or issue may tell that peer's past.
PROSE = {
    "a date": r"\b20\d\d-\d\d-\d\d\b",
    "'was' or 'now'": r"\b(was|were|now)\b",
    "a past version": r"\bused to\b|\bno longer\b|\bpreviously\b|\bearlier (version|figures?|code)\b",
}
# A peer's numbered PR or issue ("slime #2153", "(#2153)"), or a row of a table of a peer's commits
# (its short sha first, then the peer's commit date).
PEER_FACT = re.compile(r"(\w |\()#\d+|^\| `[0-9a-f]{7,40}` \|")


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of a page outside its fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lstrip("#").strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors a page's headings (and explicit ids) make; a repeated heading gets -1, -2, ..."""
    out, seen = set(), {}
    for _, line in prose_lines(path):
        if re.match(r"#{1,6} ", line):
            base = slug(line)
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
        out.update(re.findall(r"\b(?:id|name)=\"([^\"]+)\"", line))
    return frozenset(out)


LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|\b(?:src|href)=\"([^\"]+)\"")


def links(path: Path) -> list[tuple[int, str]]:
    out = []
    for n, line in prose_lines(path):
        line = re.sub(r"`[^`]*`", "", line)  # code spans hold no links
        out += [(n, a or b) for a, b in LINK.findall(line)]
    return out


def broken(path: Path) -> list[str]:
    bad = []
    for n, link in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # https:, mailto:
            continue
        file, _, anchor = link.partition("#")
        to = (path.parent / file).resolve() if file else path
        if not to.exists():
            bad.append(f"{rel(path)}:{n}: {link}: no such file")
        elif anchor and to.suffix == ".md" and anchor not in anchors(to):
            bad.append(f"{rel(path)}:{n}: {link}: no heading #{anchor} in {rel(to)}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_resolves(page):
    assert broken(page) == []


@cache
def registries() -> dict[str, int]:
    from harness.checks import all_checks
    from harness.targets.mutants import catalog
    from harness.targets.peers import peers

    every = all_checks(bitwise=True)
    adapters = peers()
    return {
        "mutants": len(catalog()),
        "fused-linear mutants": sum(m.levels == ("linear",) for m in catalog().values()),
        "checks": len(every),
        "bitwise checks": sum(c.family == "bitwise" for c in every.values()),
        "peer adapters": len(adapters),
        # those `pip install -e '.[peers]'` brings on CPU (NeMo-RL's need its source tree)
        "CPU peers": sum(not p.cuda_only and p.install.startswith("pip install") for p in adapters),
    }


# A number the docs state, and the registry it counts: "64 mutants", "64/64 mutants", "31 checks".
COUNTS = {name: re.compile(rf"(?<![\w.,/-])(\d+)(?:/(\d+))? {re.escape(name)}\b") for name in
          ("mutants", "fused-linear mutants", "checks", "bitwise checks", "peer adapters", "CPU peers")}


def stated_counts(page: Path) -> list[tuple[int, str, int]]:
    out = []
    for n, line in prose_lines(page):
        for name, pattern in COUNTS.items():
            for m in pattern.finditer(line):
                out += [(n, name, int(g)) for g in m.groups() if g is not None]
    return out


@pytest.mark.parametrize("page", [p for p in PAGES if rel(p) not in REWRITTEN_ELSEWHERE], ids=rel)
def test_stated_counts_equal_the_registries(page):
    real = registries()
    assert [f"{rel(page)}:{n}: {got} {name}, the registry holds {real[name]}"
            for n, name, got in stated_counts(page) if got != real[name]] == []


def test_the_readme_states_the_counts():
    """The README says how many mutants, checks and peers there are, so the check above has teeth."""
    said = {name for _, name, _ in stated_counts(ROOT / "README.md")}
    assert {"mutants", "checks", "peer adapters", "CPU peers"} <= said


def process_words(path: Path, prose: bool) -> list[str]:
    """Lines matching a process word: on a page (`prose`), every line for `PROCESS` (code blocks
    included: printed output says it too) and the prose, code spans left out, for `PROSE`."""
    prose_at = {n: re.sub(r"`[^`]*`", "", line) for n, line in prose_lines(path)} if prose else {}
    bad = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        rules = [(what, pattern, line) for what, pattern in PROCESS.items()]
        if n in prose_at and not PEER_FACT.search(line):
            rules += [(what, pattern, prose_at[n]) for what, pattern in PROSE.items()]
        for what, pattern, text in rules:
            m = re.search(pattern, text, re.IGNORECASE)
            if m:
                bad.append(f"{rel(path)}:{n}: {what} ({m.group(0)!r}): {line.strip()[:120]}")
    return bad


@pytest.mark.parametrize("page", [p for p in PAGES if rel(p) not in REWRITTEN_ELSEWHERE], ids=rel)
def test_pages_have_no_words_of_the_development_process(page):
    assert process_words(page, prose=True) == []


def source_files() -> list[Path]:
    files = [ROOT / f for f in SOURCE_FILES if (ROOT / f).exists()]
    for d in SOURCE_DIRS:
        files += [p for p in (ROOT / d).rglob("*") if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts]
    return sorted(files)


def test_source_has_no_words_of_the_development_process():
    assert [bad for path in source_files() for bad in process_words(path, prose=False)] == []


# --- Code the docs name ---------------------------------------------------------------------------
# A name in backticks, dotted (`harness.driver.pool`, `runner.by_group`, `Evidence.groups()`) or a
# file (`engine/calls.py`, `tests/test_cp.py::test_x`), is the project's when it starts with one of its
# packages, a module it has or had (git history: a name renamed or removed is the project's, and
# dead) or a class it defines, or when it is a file in a folder the project has or had; then it must
# exist. Anything else is another project's: torch's, a peer's (`verl/utils/...`), a variable's
# (`logits.grad`). Peer adapters are named after their peers' packages, so a short name starting with
# one (`verl.utils.kernel`) is that peer's. A part in capitals the code lacks is a placeholder
# (`tests.controls.NAME`).

PEER_ADAPTERS = ROOT / "harness" / "targets" / "peers"
NOT_CODE = {"json", "html", "md", "toml", "txt", "xml", "yaml", "csv", "png", "svg", "ini", "j2", "cpp", "so", "sh"}


@cache
def modules() -> dict[str, Path]:
    """Every module of the project by its dotted name; a package by its `__init__.py`. A folder linked
    into a package (`harness/cases`) gives its modules that name too."""
    import os

    out = {p.stem: p for p in ROOT.glob("*.py")}
    for d in SOURCE_DIRS:
        for folder, dirs, files in os.walk(ROOT / d, followlinks=True):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    parts = Path(folder, f).relative_to(ROOT).with_suffix("").parts
                    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = Path(folder, f)
    return out


@cache
def project_files() -> frozenset[str]:
    """Every `.py` path the project has, or its git history holds (none without a history)."""
    import subprocess

    run = subprocess.run(["git", "-C", str(ROOT), "log", "--no-renames", "--name-only", "--pretty=format:", "HEAD",
                          "--", "*.py"], capture_output=True, text=True, check=False)
    past = {line for line in run.stdout.splitlines() if line} if run.returncode == 0 else set()
    return frozenset(past | {p.relative_to(ROOT).as_posix() for p in modules().values()})


@cache
def project_modules() -> frozenset[str]:
    """Names of the project's modules and packages, now and in its history."""
    return frozenset(w.removesuffix(".py") for p in project_files() for w in p.split("/") if w != "__init__.py")


@cache
def tree(path: Path):
    import ast

    return ast.parse(path.read_text(), str(path))


def definitions(node) -> set[str]:
    """Names a module or class defines anywhere in it: functions, classes, assigned names and
    attributes (`self.x = ...`, dataclass fields), imported names."""
    import ast

    out = set()
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, (ast.Name, ast.Attribute)) and isinstance(n.ctx, ast.Store):
            out.add(n.id if isinstance(n, ast.Name) else n.attr)
        elif isinstance(n, ast.alias):
            out.add((n.asname or n.name).split(".")[0])
    return out


@cache
def classes() -> dict[str, frozenset[str]]:
    """The project's classes by name: what each defines, its project bases' members included."""
    import ast

    own: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    for path in modules().values():
        for n in ast.walk(tree(path)):
            if isinstance(n, ast.ClassDef):
                own.setdefault(n.name, set()).update(definitions(n))
                bases.setdefault(n.name, set()).update(b.id for b in n.bases if isinstance(b, ast.Name))

    def members(name: str, seen: frozenset[str]) -> set[str]:
        out = set(own.get(name, set()))
        for base in bases.get(name, set()) - seen:
            out |= members(base, seen | {base})
        return out

    return {name: frozenset(members(name, frozenset({name}))) for name in own}


@cache
def string_constants() -> frozenset[str]:
    """Dotted strings the code holds (an entry-point group's name, say): they exist too."""
    import ast

    return frozenset(n.value for p in modules().values() for n in ast.walk(tree(p))
                     if isinstance(n, ast.Constant) and isinstance(n.value, str) and "." in n.value)


def lacks(defined: set[str] | frozenset[str], name: str) -> bool:
    return name not in defined and not (name.isalpha() and name.isupper())  # `NAME`: a placeholder


def dead_dotted(name: str) -> str | None:
    """Why a dotted name a page gives is the project's and does not exist, or None."""
    parts = name.split(".")
    if name in string_constants() or parts[0] in {p.stem for p in PEER_ADAPTERS.glob("*.py")}:
        return None
    for k in range(len(parts), 0, -1):
        head = ".".join(parts[:k])
        found = [p for m, p in modules().items()
                 if m == head or (parts[0] not in SOURCE_DIRS and m.endswith("." + head))]
        if found:
            rest = parts[k:]
            if rest and all(lacks(definitions(tree(p)), rest[0]) for p in found):
                return f"{head} has no {rest[0]}"
            if len(rest) > 1 and rest[0] in classes() and lacks(classes()[rest[0]], rest[1]):
                return f"{rest[0]} has no {rest[1]}"
            return None
    if parts[0] in classes():
        return f"class {parts[0]} has no {parts[1]}" if lacks(classes()[parts[0]], parts[1]) else None
    return f"no module {parts[0]} in the project" if parts[0] in project_modules() else None


def dead_file(path: str, member: str | None) -> str | None:
    """Why a `.py` file a page gives (`FILE::member`) is the project's and does not exist, or None."""
    found = [p for p in modules().values() if f"/{p.relative_to(ROOT).as_posix()}".endswith(f"/{path}")]
    if found:
        if member and all(lacks(definitions(tree(p)), member.split(".")[0]) for p in found):
            return f"{path} has no {member}"
        return None
    folder, _, file = path.rpartition("/")
    if not lacks(set(), file.removesuffix(".py")):
        return None  # `harness/levels/NAME.py`: a placeholder
    ours = (any(f"/{p}".endswith(f"/{folder}/{p.rpartition('/')[2]}") for p in project_files()) if folder
            else file.removesuffix(".py") in project_modules())
    return f"no file {path} in the project" if ours else None


FILE_NAME = re.compile(r"^([\w./-]*\w\.py)(?:::([\w.]+))?$")
DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")


def named_code(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every module, class, function or file a page names in backticks."""
    out = []
    for n, line in prose_lines(path):
        for span in re.findall(r"`([^`]+)`", line):
            span = re.sub(r"^(\S+\.py):\s+(\w+)$", r"\1::\2", span.strip())  # `cases/benchmarks.py: PERF_CASES`
            for token in span.split():
                token = re.sub(r"\(.*\)$", "", token.strip(",;:'\"[]"))  # a call: `case.second()`
                if FILE_NAME.match(token) or (DOTTED.match(token) and token.rsplit(".", 1)[1] not in NOT_CODE):
                    out.append((n, token))
    return out


def dead_names(path: Path) -> list[str]:
    bad = []
    for n, name in named_code(path):
        m = FILE_NAME.match(name)
        why = dead_file(m.group(1), m.group(2)) if m else dead_dotted(name)
        if why:
            bad.append(f"{rel(path)}:{n}: `{name}`: {why}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_the_code_a_page_names_exists(page):
    assert dead_names(page) == []


# --- Figures stated twice -------------------------------------------------------------------------
# The README's Figures table holds the figures of record, each with the command that reproduces it. A
# page restates one where a sentence or a table row names that command in backticks, or in the
# paragraph right after a code block that runs it (`.venv/bin/` and `[optional parts]` aside). There,
# every number given with one of the figure's named units, word for word ("1403 case runs", "381 s
# wall", "1.43x the CLI's time to the first finding"), must be one the README gives with that unit.

NUMBER = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
QUANTITY = re.compile(rf"(?<![\w.])({NUMBER}(?:(?:, and |, | and | to |/|-){NUMBER})*)([x%])?((?: [A-Za-z][\w/'%-]*)*)")


def command(text: str) -> str:
    """A command as the docs compare it: without `.venv/bin/`, `[optional parts]` or a comment."""
    text = re.sub(r"\[[^\]]*\]|\s#.*$", "", text).replace(".venv/bin/", "")
    return " ".join(text.split())


def quantities(text: str) -> dict[str, set[float]]:
    """Unit (the words after a number, lower case) -> the numbers a text gives with it. A bare unit
    ("381 s", "1.4x") names no quantity, and is left out."""
    text = re.sub(r"`[^`]*`", "CODE", re.sub(r"\]\([^)]*\)", "]", text))  # code spans and link targets
    out: dict[str, set[float]] = {}
    for numbers, glued, words in QUANTITY.findall(text):
        unit = f"{glued}{words}".strip().lower()
        if len(unit) > 3 or " " in unit:  # a name, not a bare unit ("s", "x", "min")
            out.setdefault(unit, set()).update(float(n.replace(",", "")) for n in re.findall(NUMBER, numbers))
    return out


@cache
def figures_of_record() -> dict[str, dict[str, set[float]]]:
    """Command -> the quantities its row of the README's Figures table gives."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("\n## Figures"):]
    out = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`[^`]+`", cells[2]):
            out[command(cells[2].strip("`"))] = quantities(cells[1])
    return out


def statements(path: Path) -> list[tuple[int, str, str]]:
    """(line, command, text) where a page states something about a figure's command: its sentences
    and table rows that name it in backticks, and the paragraph after a code block that runs it.
    The README's own Figures table is the record, not a statement."""
    commands = figures_of_record()
    out: list[tuple[int, str, str]] = []

    def said(paragraph: list[tuple[int, str]], after: str | None) -> None:
        if after is not None:
            out.append((paragraph[0][0], after, " ".join(text for _, text in paragraph)))
        rows = [(n, text) for n, text in paragraph if text.lstrip().startswith("|")]
        prose = " ".join(text.strip() for n, text in paragraph if not text.lstrip().startswith("|"))
        pieces = rows + [(paragraph[0][0], p) for p in re.split(r"(?<=[.!?])\s+(?=[A-Z`(*])", prose) if p]
        for n, piece in pieces:
            out.extend((n, command(c), piece) for c in re.findall(r"`([^`]+)`", piece) if command(c) in commands)

    fenced, after, paragraph = False, None, []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if path == ROOT / "README.md" and line.startswith("## Figures"):
            break
        fence = line.lstrip().startswith(("```", "~~~"))
        fenced ^= fence
        code = fence or fenced or (line.startswith("    ") and not paragraph)
        if code or not line.strip():
            if paragraph:
                said(paragraph, after)
                after = None
            paragraph = []
            if code and command(line) in commands:
                after = command(line)
            continue
        paragraph.append((n, line))
    if paragraph:
        said(paragraph, after)
    return out


def restated_otherwise(path: Path) -> list[str]:
    bad = []
    for n, cmd, text in statements(path):
        record = figures_of_record()[cmd]
        for unit, numbers in quantities(text).items():
            if unit in record and not numbers <= record[unit]:
                said = ", ".join(f"{x:g}" for x in sorted(numbers - record[unit]))
                bad.append(f"{rel(path)}:{n}: {said} {unit} for `{cmd}`, where the README's figures say "
                           f"{', '.join(f'{x:g}' for x in sorted(record[unit]))}")
    return bad


def test_the_readme_has_figures_of_record():
    """The check below has teeth: the Figures table parses into commands and their quantities."""
    record = figures_of_record()
    assert len(record) >= 10 and all(record.values())
    assert record["python benchmarks/throughput.py --cases 100"]["case runs/s at tp"] == {55.6, 90.5, 41.2}


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_a_figure_of_record_is_restated_with_its_value(page):
    assert restated_otherwise(page) == []
