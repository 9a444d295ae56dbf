"""`harness history` and `harness repro` for `git bisect run` on a repository built here (three
versions of a tiny routine module: clean, a mutant's defect, the fix), and the capabilities read off
the signatures of routines older than the contract (docs/history.md)."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.base.errors import TargetError
from harness.cli import main
from harness.commands import history
from harness.commands.repro import UNTESTABLE
from harness.driver.git_trees import Commit, Git, commits
from harness.driver.replay import CommitOutcome
from harness.report import history_table as table
from harness.report.history_table import history_rows, render_html, render_markdown, transitions
from harness.targets import from_namespace

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")

# A kernel older than `with_entropy_grad`; its defective version is a mutant's (wrong entropy-gradient sign).
ROUTINE = '''from harness.targets.mutants import mutant_namespace

_routine = mutant_namespace({mutant!r}) if {mutant!r} else None
from harness.targets import fused


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None):
    kernel = (_routine or fused).calculate_log_probs_and_entropy
    return kernel(logits, tokens, tp_group, with_entropy=with_entropy, chunk_size=chunk_size,
                  log_prob_keep_mask=log_prob_keep_mask)
'''
# A case the defect fails (entropy in the loss, logits requiring grad).
CASE = ("kernel:tp=1,T=6,v_local=5,dtype=fp32,regime=normal,chunk_size=-1,mask=none,with_entropy=1,"
        "with_entropy_grad=1,requires_grad=1,loss_terms=both,seed=1822")


def _git(repo: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env, timeout=60).stdout.strip()


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """clean -> defect -> an unrelated commit -> fix (the clean file again); their shas by name."""
    path = tmp_path_factory.mktemp("routine-repo")
    _git(path, "init", "-q")
    shas = {}
    for name, file, text in (("clean", "lp.py", ROUTINE.format(mutant="")),
                             ("defect", "lp.py", ROUTINE.format(mutant="entropy-grad-sign")),
                             ("readme", "README", "not the routine\n"),
                             ("fix", "lp.py", ROUTINE.format(mutant=""))):
        (path / file).write_text(text)
        _git(path, "add", file)
        _git(path, "commit", "-q", "-m", name)
        shas[name] = _git(path, "rev-parse", "HEAD")
    return path, shas


def test_history_finds_the_defect_and_the_fix(repo, tmp_path, capsys):
    path, shas = repo
    out = tmp_path / "out"
    assert main(["history", str(path), "--target", "lp", "--profile", "smoke", "--tp", "1", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    h = json.loads((out / "history.json").read_text())
    assert [r["subject"] for r in h["rows"]] == ["clean", "defect", "fix"]  # the README commit touches no target file
    clean, defect, fix = h["rows"]
    assert fix["same_as"] == shas["clean"] and h["checked"] == 2  # the fix repeats the clean file: not run again
    assert all(r["inferred"] == {"metric_only_entropy": False} for r in h["rows"])
    # The defect is the entropy term's gradient: its family, not the log-prob term's, fails.
    assert clean["cells"]["gradients [entropy]"]["state"] == "pass"
    assert defect["cells"]["gradients [entropy]"]["state"] == "finding"
    assert defect["cells"]["gradients [log-prob]"]["state"] == "pass"
    stretch = next(t for t in h["transitions"] if t["family"] == "gradients [entropy]")
    assert {"introduced": shas["defect"][:10], "fixed": shas["fix"][:10]}.items() <= stretch.items()
    assert f"| `{shas['defect'][:10]}` |" in table and "FAILS FROM HERE" in table and "FIXED HERE" in table
    assert (out / f"{shas['defect'][:10]}.json").exists() and (out / "history.html").exists()
    # The stretch's repro names the repository and the defect commit, and its case is the shrunk finding's.
    assert stretch["shrunk"] and stretch["repro"].startswith(
        f"python -m harness repro --repo {path} --commit {shas['defect']} --target lp ")
    finding = next(f for f in json.loads((out / f"{shas['defect'][:10]}.json").read_text())["findings"]
                   if f["shrunk"] and f["family"] == "gradients [entropy]")
    assert stretch["case"] == finding["case"] and shlex.split(stretch["repro"])[-1] == finding["case"]
    # Printed as `check` prints it, with the line that outlives the run.
    block = table[table.index("\nFINDING [gradients]"):]
    assert block.startswith(f"\nFINDING [gradients] (kernel) shrunk, start from this one: {finding['case']}\n")
    assert f"  repro: {stretch['repro']}" in block.splitlines()


def test_history_repro_line_outlives_the_run_and_checks_its_commit(repo, tmp_path, capsys, monkeypatch):
    """The printed line re-runs the commit's own tree after the run's trees are deleted, from a
    directory whose `lp` is another version (the line must not import the user's checkout)."""
    path, shas = repo
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lp.py").write_text(ROUTINE.format(mutant=""))  # a clean `lp` where the user stands
    line = f"python -m harness repro --repo {path} --commit {shas['defect']} --target lp {shlex.quote(CASE)}"
    assert main(shlex.split(line)[3:]) == 1  # the defect commit fails, though ./lp.py is clean
    assert main(shlex.split(line.replace(shas["defect"], shas["fix"]))[3:]) == 0
    assert main(["repro", "--repo", str(path), "--commit", shas["readme"], "--target", "nosuchmodule", CASE]) \
        == UNTESTABLE


# A peer adapter that imports its peer inside its calls, as verl's does, next to a peer whose
# package `__init__` does not import here (verl's 2025 commits import pkg_resources).
ADAPTER = '''HARNESS_PEER = dict(requires=("fakepeer",), install="put fakepeer on PYTHONPATH",
                    upstream=("fakepeer.ops.log_probs",))


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    from fakepeer.ops import log_probs

    return log_probs(logits, tokens, tp_group, with_entropy)
'''


def test_a_commit_whose_peer_does_not_import_here_is_untestable(tmp_path, capsys):
    path = tmp_path / "peer-repo"
    (path / "fakepeer").mkdir(parents=True)
    _git(path, "init", "-q")
    (path / "peer_adapter.py").write_text(ADAPTER)
    (path / "fakepeer" / "__init__.py").write_text("import a_module_that_does_not_exist\n")
    (path / "fakepeer" / "ops.py").write_text("def log_probs(logits, tokens, tp_group, with_entropy):\n    pass\n")
    _git(path, "add", ".")
    _git(path, "commit", "-q", "-m", "a peer that does not import")
    out = tmp_path / "out"
    assert main(["history", str(path), "--target", "peer_adapter", "--profile", "smoke", "--tp", "1",
                 "--out", str(out)]) == 0
    (row,) = json.loads((out / "history.json").read_text())["rows"]
    assert row["status"] == "untestable", row
    assert row["reason"] == ("peer_adapter: fakepeer.ops cannot be imported here: "
                             "ModuleNotFoundError: No module named 'a_module_that_does_not_exist'")


def test_a_module_without_any_contract_function_is_refused_at_once(repo, tmp_path, capsys):
    """A trainer's own module (verl's tensor_parallel.py) holds none of the contract's functions in
    any commit: every commit would be untestable, each after a check's start-up. Refused before
    any commit is checked, with the way to check it (an adapter, with --paths); a file target
    without --paths is refused saying what to give."""
    path = tmp_path / "trainer"
    (path / "pkg").mkdir(parents=True)
    _git(path, "init", "-q")
    (path / "pkg" / "__init__.py").write_text("")
    for body in ("def vocab_parallel_entropy(logits):\n    pass\n", "def vocab_parallel_log_probs(logits):\n    pass\n"):
        (path / "pkg" / "ops.py").write_text(body)
        _git(path, "add", ".")
        _git(path, "commit", "-q", "-m", "ops")
    start = time.monotonic()
    assert main(["history", str(path), "--target", "pkg.ops", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert time.monotonic() - start < 30 and not (tmp_path / "out").exists()
    assert "pkg.ops defines none of the contract's functions" in err and "in any of the 2 commit(s)" in err, err
    assert "--paths pkg/ops.py" in err
    repo_path, _ = repo
    assert main(["history", str(repo_path), "--target", str(repo_path / "lp.py")]) == 2
    assert "is a file: history cannot tell which of the repository's files its commits change; name them with " \
           "--paths" in capsys.readouterr().err


def _contract_functions() -> list[tuple[str, str]]:
    from harness.base import levels
    return [(lvl.name, c.name) for lvl in levels.all_levels().values() for c in lvl.contracts.values()]


@pytest.mark.parametrize("level,function", _contract_functions())
def test_a_module_of_one_levels_function_is_taken(tmp_path, level, function):
    """Any one contract function, of any level, is something to check: history goes on with it."""
    path = tmp_path / "trainer"
    (path / "pkg").mkdir(parents=True)
    _git(path, "init", "-q")
    (path / "pkg" / "__init__.py").write_text("")
    (path / "pkg" / "ops.py").write_text(f"from harness.targets.fused import {function}  # noqa: F401\n")
    _git(path, "add", ".")
    _git(path, "commit", "-q", "-m", "ops")
    git = Git(path)
    rev = git("rev-parse", "HEAD").strip()
    history._refuse_without_contract(git, "pkg.ops", rev, commits(git, ["pkg/ops.py"], None, rev))  # no UsageError


def test_history_of_a_distillation_only_module_checks_its_commit(tmp_path, capsys):
    """A module that exports only one distillation function is checked at that level, end to end."""
    path = tmp_path / "trainer"
    path.mkdir()
    _git(path, "init", "-q")
    (path / "kd.py").write_text("from harness.targets.fused import distill_gather  # noqa: F401\n")
    _git(path, "add", ".")
    _git(path, "commit", "-q", "-m", "kd")
    out = tmp_path / "out"
    assert main(["history", str(path), "--target", "kd", "--profile", "smoke", "--tp", "1", "--out", str(out)]) == 0
    row = json.loads((out / "history.json").read_text())["rows"][0]
    assert row["status"] == "checked" and not any(c["state"] == "finding" for c in row["cells"].values()), row


MARK = "HARNESS_HISTORY_TEST_RUN"  # in the environment of every process a run below starts


def _started(mark: str) -> dict[int, str]:
    """The live processes whose environment carries MARK=mark: their command lines, by pid."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if f"{MARK}={mark}".encode() not in (proc / "environ").read_bytes().split(b"\0") \
                    or (proc / "stat").read_bytes().rsplit(b")", 1)[1].split()[0] == b"Z":
                continue
            found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):  # not a process, gone, or not ours to read
            continue
    return found


def test_sigterm_stops_the_history_and_every_process_it_started(repo, tmp_path):
    """A CI runner cancelling, then Ctrl-C while the run stops: the run's checks (each in a session of
    its own, with a worker pool of its own) are stopped with it, within seconds, the second signal
    notwithstanding, and its exported trees are deleted."""
    path, _ = repo
    mark, tmp = uuid.uuid4().hex, tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp), **{MARK: mark})
    run = subprocess.Popen([sys.executable, "-m", "harness", "history", str(path), "--target", "lp", "--profile",
                            "smoke", "--tp", "1", "--jobs", "2", "--out", str(tmp_path / "out")],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        # Both versions' checks and a worker forked by one of them (its command line is the check's).
        while sum(" harness check " in cmd for cmd in _started(mark).values()) < 3:
            assert run.poll() is None and time.monotonic() < deadline, "the checks did not start"
            time.sleep(0.1)
        run.send_signal(signal.SIGTERM)
        start = time.monotonic()
        time.sleep(0.5)
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=15)
        assert time.monotonic() - start < 15 and run.returncode == 128 + signal.SIGTERM, err
        assert "interrupted by SIGTERM" in err
        assert not _started(mark)
        assert not list(tmp.glob("harness-history-*"))
    finally:
        run.kill()
        for pid in _started(mark):  # what a failure left behind
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_git_bisect_run_names_the_defect_commit(repo, tmp_path):
    path, shas = repo
    work = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(path), str(work)], check=True, timeout=60)
    _git(work, "bisect", "start", shas["readme"], shas["clean"])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run(["git", "bisect", "run", sys.executable, "-m", "harness", "repro", "--target", "lp", CASE],
                         cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert f"{shas['defect']} is the first bad commit" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]


@pytest.mark.parametrize("target, case", [
    ("tests.broken.bad_signature", CASE),  # the contract cannot call it
    ("tests.broken.import_error", CASE),  # not importable
    ("mutant:linear-bf16-matmul", "wrapper:tp=1,v_local=5,total_lengths=3,response_lengths=2"),  # no such level
])
def test_repro_exits_125_when_the_target_is_untestable(target, case, capsys):
    assert main(["repro", "--target", target, case]) == UNTESTABLE
    assert "untestable" in capsys.readouterr().err


def _kernel_without(*params: str):
    names = ["logits", "tokens", "tp_group", "with_entropy=False", "chunk_size=-1", "log_prob_keep_mask=None",
             "with_entropy_grad=True"]
    kept = [n for n in names if n.partition("=")[0] not in params]
    scope: dict = {}
    exec(f"def calculate_log_probs_and_entropy({', '.join(kept)}):\n    return None, None", scope)
    return scope["calculate_log_probs_and_entropy"]


def _wrapper(logits, *, args, unconcat_tokens, total_lengths, response_lengths, with_entropy=False,
             non_loss_data=True):
    return None, {}


def test_capabilities_inferred_from_the_signatures():
    t = from_namespace("old", SimpleNamespace(calculate_log_probs_and_entropy=_kernel_without("with_entropy_grad"),
                                              get_log_probs_and_entropy=_wrapper))
    assert t.levels == ("kernel", "wrapper")
    assert t.inferred == {"metric_only_entropy": False, "top_p": False}
    assert not t.supports("metric_only_entropy") and not t.supports("top_p") and t.supports("keep_mask")
    assert t.kwargs("kernel", with_entropy=True, with_entropy_grad=True) == {"with_entropy": True}
    assert t.kwargs("wrapper", with_entropy=True, top_p_token_ids=None) == {"with_entropy": True}
    assert any("with_entropy_grad" in note and "metric_only_entropy inferred False" in note for note in t.fit_notes())


def test_a_level_that_cannot_be_called_is_not_checked_and_the_others_run():
    t = from_namespace("half", SimpleNamespace(calculate_log_probs_and_entropy=_kernel_without("tp_group"),
                                               get_log_probs_and_entropy=_wrapper))
    assert t.levels == ("wrapper",) and "missing tp_group" in t.not_checked["kernel"]
    assert any(note.startswith("kernel: not checked:") for note in t.fit_notes())


def test_contract_error_shows_both_signatures_and_the_missing_parameter():
    with pytest.raises(TargetError) as e:
        from_namespace("mine", SimpleNamespace(calculate_log_probs_and_entropy=_kernel_without("tp_group")))
    msg = str(e.value)
    assert "mine.calculate_log_probs_and_entropy(logits, tokens, with_entropy=False" in msg  # given
    assert "contract calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False" in msg  # expected
    assert msg.endswith("missing tp_group") and "\n" not in msg
    extra = lambda logits, tokens, tp_group, scale, with_entropy=False, chunk_size=-1: None  # noqa: E731
    with pytest.raises(TargetError, match="extra required scale"):
        from_namespace("mine", SimpleNamespace(calculate_log_probs_and_entropy=extra))


SLIME = Path(os.environ.get("SLIME_REPO", "slime"))  # a git clone (or bare mirror) of THUDM/slime
FIRST_FUSED = "6a0ee1588"  # slime PR #2144: the fused kernel, before with_entropy_grad (#2152)


@pytest.mark.slow
@pytest.mark.skipif(not SLIME.exists(), reason="no slime repository: set SLIME_REPO to a git clone of https://github.com/THUDM/slime")
def test_slime_first_fused_commit_is_checked_with_its_capability_inferred(tmp_path):
    pytest.importorskip("httpx", reason="slime's modules import httpx")
    out = tmp_path / "out"
    assert main(["history", str(SLIME), "--target", "slime.backends.megatron_utils.loss", "--paths",
                 "slime/utils/ppo_utils.py", "slime/backends/megatron_utils/loss.py", "--since", FIRST_FUSED,
                 "--rev", FIRST_FUSED, "--profile", "smoke", "--tp", "1", "--out", str(out)]) == 0
    (row,) = json.loads((out / "history.json").read_text())["rows"]
    assert row["status"] == "checked" and row["inferred"] == {"metric_only_entropy": False}
    assert row["levels"] == ["kernel", "wrapper"]


def test_a_mirror_without_some_blobs_is_exported_without_them(tmp_path):
    """Snapshots leave large files out: the commit's tree is written file by file, those left out."""
    from harness.driver.git_trees import Git

    repo = tmp_path / "mirror"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "lp.py").write_text("X = 1\n")
    (repo / "big.svg").write_text("<svg/>" * 100)
    _git(repo, "add", "lp.py", "big.svg")
    _git(repo, "commit", "-q", "-m", "two files")
    blob = _git(repo, "rev-parse", "HEAD:big.svg")
    (repo / ".git" / "objects" / blob[:2] / blob[2:]).unlink()  # the blob the snapshot lacks
    out = tmp_path / "tree"
    out.mkdir()
    assert Git(repo).export("HEAD", out) == ["big.svg"]
    assert (out / "lp.py").read_text() == "X = 1\n" and not (out / "big.svg").exists()


def _history(rows: list[dict], families: list[str]) -> dict:
    """What `cmd_history` renders, around hand-built rows."""
    return {"repo": "/r", "target": "lp", "paths": ["lp.py"], "profile": "smoke", "tp": [1], "checked": len(rows),
            "elapsed_s": 1.0, "families": families, "rows": rows, "transitions": transitions(rows)}


def _family(check: str, term: str = "", failed: int = 0, known: int = 0) -> dict:
    return {"check": check, "term": term, "context": "", "label": check, "applied": 40, "failed": failed,
            "beyond": 0, "known": known, "configs": {"tp=1": [40, failed + known]}}


def test_a_family_counted_failing_without_a_finding_recorded_is_rendered():
    """A result counts a family's failures without listing a finding of it (a check keeps the first
    KNOWN_KEPT known findings, and stops at --max-findings): the page says what is known."""
    result = {"cases_run": 40, "levels": ["kernel"], "findings": [], "known_findings": [],
              "families": {"gradients [entropy]": _family("gradients", "entropy", known=3),
                           "values": _family("values", failed=2)}}
    commit = Commit("a" * 40, "cut", "2024-01-01", "blob")
    rows = history_rows([commit], {commit.sha: CommitOutcome("checked", result=result)})
    h = _history(rows, ["gradients [entropy]", "values"])
    page = render_html(h)
    assert 'title="3 failing case(s) counted, no finding recorded' in page
    assert 'title="2 failing case(s) counted, no finding recorded' in page
    text = render_markdown(h)
    assert "FAILS ALREADY: known (3/40)" in text and text.count("| not fixed | no finding recorded |") == 2


def test_the_table_is_well_formed_when_no_commit_is_testable():
    """No family column at all: the header, its separator and each row have the same cells."""
    listed = [Commit(c * 40, "old", "2024-01-01", "blob") for c in "bc"]
    rows = history_rows(listed, {c.sha: CommitOutcome("untestable", reason="lp: no module named lp") for c in listed})
    text = render_markdown(_history(rows, []))
    table = text.split("\n\n")[2].splitlines()
    assert len(table) == 4 and all(line.count("|") == 5 for line in table), text
    assert table[0] == "| commit | authored | subject | result |" and table[1] == "|---|---|---|---|"
    assert "No commit could be checked" in text


def test_the_dates_shown_are_the_author_dates(tmp_path, monkeypatch):
    """A rebased branch's commits share one committer date: each row shows when its change was written."""
    path = tmp_path / "rebased"
    path.mkdir()
    _git(path, "init", "-q")
    monkeypatch.setenv("GIT_COMMITTER_DATE", "2024-05-09T12:00:00")
    for day in (1, 2):
        (path / "lp.py").write_text(f"X = {day}\n")
        _git(path, "add", "lp.py")
        _git(path, "commit", "-q", "-m", f"day {day}", "--date", f"2024-03-0{day}T12:00:00")
    listed = commits(Git(path), ["lp.py"], None, "HEAD")
    rows = history_rows(listed, {c.sha: CommitOutcome("untestable", reason="r") for c in listed})
    assert [r["date"] for r in rows] == ["2024-03-01", "2024-03-02"]
    text, page = render_markdown(_history(rows, [])), render_html(_history(rows, []))
    assert "| commit | authored | subject | result |" in text and "<th>authored</th>" in page
    assert "| 2024-03-02 | day 2 |" in text and "<td>2024-03-02</td>" in page
    assert "2024-05-09" not in text + page


# ---------------------------------------------------------------------------- --perf (docs/performance.md)
def _perf_rows() -> list[dict]:
    """Two checked commits, the second with slime #2144's changes at TP 1 (fp32)."""
    listed = [Commit(c * 40, s, "2026-06-29", "blob") for c, s in (("a", "top-p"), ("b", "perf: fuse"))]
    rows = history_rows(listed, {c.sha: CommitOutcome("untestable", reason="r") for c in listed})
    case = "tp1 T128xV2048 fp32 ent-grad"
    rows[0]["perf"] = {"changes": [], "notes": ["the first commit with figures: nothing to compare with"],
                       "figures": {case: {"retained_bytes": 3_148_416, "peak_bytes": 4_721_796, "collectives": 5,
                                          "instructions": 9e6, "time_s": 0.004}}}
    rows[1]["perf"] = {"against": rows[0]["short"], "notes": [], "changes": [
        {"metric": "all_reduce per call", "case": case, "spec": "k", "before": 5, "after": 4, "ratio": 0.8,
         "direction": "improvement"},
        {"metric": "peak backward bytes", "case": case, "spec": "k", "before": 4_721_796, "after": 5_248_132,
         "ratio": 1.111, "direction": "regression"}],
        "figures": {case: {"retained_bytes": 1_051_264, "peak_bytes": 5_248_132, "collectives": 4,
                           "instructions": 5e6, "time_s": 0.002}}}
    return rows


def test_perf_changes_are_a_column_a_table_and_console_lines():
    h = {**_history(_perf_rows(), []), "perf": True}
    text, page = render_markdown(h), render_html(h)
    head = "| commit | authored | subject | result | perf |"
    assert head in text and "<th>perf</th>" in page
    row = next(line for line in text.splitlines() if line.startswith("| `bbbbbbbbbb`"))
    assert "PERF CHANGES HERE: regression: peak backward bytes x1.11 (1 case); improvement: all_reduce per call 5 -> 4" in row
    assert "| `bbbbbbbbbb` | `aaaaaaaaaa` | peak backward bytes | tp1 T128xV2048 fp32 ent-grad | 4,721,796 | 5,248,132 | 1.111 | regression |" in text
    assert "perf-regression" in page and "PERF CHANGES HERE" in page
    console = "\n".join(table.perf_lines(h))
    assert "PERF CHANGES HERE on bbbbbbbbbb (perf: fuse), against aaaaaaaaaa" in console
    assert "improvement all_reduce per call: 5 -> 4 (0.800)" in " ".join(console.split())


def test_trend_reads_a_historys_perf_rows(tmp_path):
    from harness.commands import trend

    h = {**_history(_perf_rows(), []), "perf": True}
    (tmp_path / "history.json").write_text(json.dumps(h))
    (tmp_path / "aaaaaaaaaa.baseline.json").write_text(json.dumps(  # the record the first row stands for
        {"format": "harness-baseline/1", "created": "2026-01-01", "cases": [{"case": "k", "time_s": 1.0}]}))
    runs = trend.load_runs(tmp_path)
    assert [r.label.split()[0] for r in runs] == ["aaaaaaaa", "bbbbbbbb"]  # in the history's order, once each
    case = "tp1 T128xV2048 fp32 ent-grad"
    assert [r.values["retained"][case] for r in runs] == [3_148_416, 1_051_264]
    assert [r.values["collectives"][case] for r in runs] == [5, 4]
    assert {"time", "instructions", "memory", "retained", "collectives"} == set(runs[1].values)


def _routine_repo(path: Path, versions: list[tuple[str, str]]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    _git(path, "init", "-q")
    for subject, text in versions:
        (path / "lp.py").write_text(text)
        _git(path, "add", "lp.py")
        _git(path, "commit", "-q", "-m", subject)
    return path


PERF_ROUTINE = '''from harness.targets import fused
from harness.targets.mutants import mutant_namespace

# {note}
_routine = mutant_namespace({mutant!r}) if {mutant!r} else fused
calculate_log_probs_and_entropy = _routine.calculate_log_probs_and_entropy
'''


def _perf_history(repo: Path, out: Path, jobs: str = "2") -> dict:
    assert main(["history", str(repo), "--target", "lp", "--profile", "smoke", "--tp", "1", "--perf",
                 "--jobs", jobs, "--out", str(out)]) == 0
    return json.loads((out / "history.json").read_text())


@pytest.mark.slow
def test_a_perf_mutant_is_a_regression_on_its_commit(tmp_path, capsys):
    """The clean routine, then the needless-pass mutant: the mutant's commit, and only it, is marked,
    with its instructions counted (when valgrind is here) and its time paired."""
    from harness.perf import callgrind

    repo = _routine_repo(tmp_path / "repo", [("clean", PERF_ROUTINE.format(note="", mutant="")),
                                             ("slower", PERF_ROUTINE.format(note="", mutant="needless-exp-pass"))])
    h = _perf_history(repo, tmp_path / "out")
    first, second = h["rows"]
    assert first["perf"]["changes"] == [] and second["perf"]["against"] == first["short"]
    metrics = {c["metric"] for c in second["perf"]["changes"]}
    assert {c["direction"] for c in second["perf"]["changes"]} == {"regression"}
    assert "peak forward bytes" in metrics and "time (ms)" in metrics
    if callgrind.available() is None:
        assert "instructions" in metrics
    assert "PERF CHANGES HERE on " + second["short"] in capsys.readouterr().out


@pytest.mark.slow
def test_identical_commits_give_no_perf_change_over_ten_repeats(tmp_path):
    """Eleven commits of one routine that differ by a comment only: ten comparisons of identical code,
    each with its instructions counted and its time paired; none is a change (docs/performance.md)."""
    repo = _routine_repo(tmp_path / "repo", [(f"comment {i}", PERF_ROUTINE.format(note=f"revision {i}", mutant=""))
                                             for i in range(11)])
    h = _perf_history(repo, tmp_path / "out")
    compared = [r for r in h["rows"] if "against" in r["perf"]]
    assert len(compared) == 10
    assert [c for r in compared for c in r["perf"]["changes"]] == []
    assert not any(n.startswith("time: not judged") for r in compared for n in r["perf"]["notes"])
