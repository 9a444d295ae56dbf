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
