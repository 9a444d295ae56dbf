"""A finding's family (the check, the output term, the call context that decides it) and its use
(in or beyond the target's declared `HARNESS_USE`), as findings, known files, the console, history
and the stand-alone scripts of `harness repro --script` read them."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from harness.base.errors import TargetError
from harness.cases.case import parse_case
from harness.checks import script as scripts
from harness.checks.families import config_key, where
from harness.checks.findings import BEYOND_USE, IN_USE, Finding, gated
from harness.checks.known import KnownFindings, load
from harness.checks.problems import ENTROPY, LOG_PROB, Problem, output_of
from harness.checks.terms import gradient_terms
from harness.checks.tolerance import compare
from harness.checks.use import parse_use
from harness.driver.git_trees import Commit
from harness.driver.replay import CommitOutcome
from harness.driver.runner import Runner
from harness.report.console import finding_blocks
from harness.report.history_table import history_rows, render_markdown, transitions

# A correct TP-1 routine (torch's own log-softmax) that raises on an empty batch, which its callers
# never make: its HARNESS_USE says so.
ROUTINE = '''
import torch

HARNESS_CAPABILITIES = {"tensor_parallel": False}
HARNESS_USE = [{"where": {"T": 0}, "why": "trainer/batches.py:12: every micro-batch holds tokens"}]


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    if logits.shape[0] == 0:
        raise ValueError("no rows")
    x = logits.float()
    lsm = torch.log_softmax(x, dim=-1)
    lp = lsm.gather(-1, tokens.reshape(-1, 1).long()).squeeze(-1)
    ent = None
    if with_entropy:
        ent = -(lsm.exp() * lsm).sum(-1)
        ent = ent if with_entropy_grad else ent.detach()
    return lp, ent
'''


def _module(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_a_problem_says_its_output_and_a_gradient_its_loss_terms() -> None:
    problems, worst = compare(torch.tensor([0.5, 1.0]), torch.tensor([0.5, 0.0], dtype=torch.float64),
                              torch.tensor([1e-6, 1e-6], dtype=torch.float64), "rank 0 log_prob", LOG_PROB)
    (p,) = problems
    assert output_of(p) == LOG_PROB and p.index == (1,) and (p.actual, p.expected, p.bound) == (1.0, 0.0, 1e-6)
    assert p.startswith("rank 0 log_prob: worst at [1]") and worst == pytest.approx(1e6)
    assert pickle.loads(pickle.dumps(p)).output == LOG_PROB  # it crosses processes as it is
    # The words do not decide: a problem about the entropy that names the log-prob is the entropy's.
    assert output_of(Problem("entropy differs from log_prob's", ENTROPY)) == ENTROPY
    assert output_of("rank 0: the wrapper raised with entropy_coef absent") == ""  # a plain string names none
    with pytest.raises(ValueError):
        Problem("x", "logits")
    both = parse_case("kernel:tp=2,T=3,v_local=4,seed=1")
    wrong = {"log_prob": True, "entropy": False}
    assert gradient_terms(both, lambda c: wrong[c.loss_terms]) == ("log-prob",)
    assert gradient_terms(both, lambda c: True) == ("log-prob", "entropy")
    assert gradient_terms(both, lambda c: None) == ()  # a case alone that did not get through: not told
    assert gradient_terms(both.replace(with_entropy=False), lambda c: pytest.fail("no probe needed")) == ("log-prob",)


def test_a_family_says_what_its_failing_configurations_share() -> None:
    tp2, tp1 = parse_case("kernel:tp=2,T=3,v_local=4"), parse_case("kernel:tp=1,T=3,v_local=8")
    chunked = config_key(tp2.replace(chunk_size=2))
    assert where({config_key(tp2): [3, 3], chunked: [2, 1], config_key(tp1): [4, 0]}) == "at TP > 1"
    assert where({config_key(tp2): [3, 1], config_key(tp1): [4, 1]}) == ""  # nothing sets them apart
    assert where({config_key(tp2): [3, 3], config_key(tp1): [4, 0]}) == ""  # one configuration: nothing general


def test_use_entries_are_validated_and_match_by_check_term_and_fields() -> None:
    entries = parse_use("t", [{"where": {"regime": "neginf"}, "why": "a.py:1"},
                              {"where": {}, "check": "gradients", "term": "entropy", "why": "b.py:2"}])
    spec = "kernel:tp=2,T=3,v_local=4,seed=1"
    grad = Finding("gradients", "kernel", spec, "m", "r", term="entropy")
    assert entries[1].matches(grad) and not entries[1].matches(Finding("gradients", "kernel", spec, "m", "r",
                                                                        term="log-prob"))
    assert entries[0].matches(Finding("values", "kernel", spec + ",regime=neginf", "m", "r"))
    for bad in ({"where": {"regime": "nan"}, "why": "x"}, {"where": {}, "why": "x", "term": "loss"},
                {"where": {}}, {"where": {}, "why": "x", "reason": "y"}):
        with pytest.raises(TargetError):
            parse_use("t", [bad])


def test_a_known_entry_may_name_the_term(tmp_path) -> None:
    path = tmp_path / "k.toml"
    path.write_text('[[known]]\ncheck = "gradients"\nterm = "entropy"\nreason = "metric only"\n')
    known = load(path)
    spec = "kernel:tp=2,T=3,v_local=4"
    assert known.classify(Finding("gradients", "kernel", spec, "m", "r", term="entropy")) is not None
    assert known.classify(Finding("gradients", "kernel", spec, "m", "r", term="log-prob")) is None
    path.write_text('[[known]]\ncheck = "gradients"\nterm = "loss"\nreason = "x"\n')
    with pytest.raises(Exception, match="unknown term"):
        load(path)


@pytest.mark.distributed
def test_findings_beyond_the_use_are_marked_and_printed_after_those_in_it(harness_pools, tmp_path) -> None:
    runner = Runner(_module(tmp_path, "empty_raises", ROUTINE), pools=harness_pools)
    runner.verdicts.known = KnownFindings()
    _, beyond = runner.check(parse_case("kernel:tp=1,T=0,v_local=4"))
    assert [(f.check, f.use) for f in beyond] == [("empty-input", BEYOND_USE)]
    assert beyond[0].beyond == "trainer/batches.py:12: every micro-batch holds tokens"
    in_use = Finding("values", "kernel", "kernel:tp=1,T=3,v_local=4", "rank 0 log_prob: off", "repro", shrunk=True,
                     term="log-prob")
    text = "\n".join(finding_blocks([*beyond, in_use]))
    assert text.index("FINDING [values]") < text.index("BEYOND THE TARGET'S USE") < text.index("FINDING [empty-input]")
    assert "about: log-prob values" in text and "beyond the target's use: trainer/batches.py:12" in text


@pytest.mark.distributed
def test_a_nan_both_ways_is_finites_finding_not_an_invariances(harness_pools) -> None:
    """The same NaN chunked and unchunked, at TP 2 and TP 1: `finite` finds it; `chunk-invariance` and
    `tp-invariance` compare two runs that agree, NaN for NaN, and find nothing."""
    runner = Runner("tests.targets.nan_first_row", pools=harness_pools)
    case = parse_case("kernel:tp=2,T=6,v_local=5,chunk_size=2,seed=3")
    _, findings = runner.check(case)
    fired = {f.check for f in findings}
    assert {"finite", "values"} <= fired and not fired & {"chunk-invariance", "tp-invariance"}, fired
    assert runner.verdicts.stats[("chunk-invariance", "kernel")].applied == 1
    assert runner.verdicts.stats[("tp-invariance", "kernel")].applied == 1


def test_a_gradient_finding_is_split_by_the_term_it_comes_from(harness_pools) -> None:
    """The entropy-gradient sign mutant: with both terms in the loss, only the entropy's family fails."""
    runner = Runner("mutant:entropy-grad-sign", pools=harness_pools)
    _, found = runner.check(parse_case("kernel:tp=1,T=3,v_local=4,seed=1"), only={"gradients"})
    assert [f.family for f in found] == ["gradients [entropy]"]
    fams = runner.verdicts.families
    assert fams["gradients [entropy]"].failed == 1 and fams["gradients [log-prob]"].failed == 0


def _commit(sha: str) -> Commit:
    return Commit(sha=sha * 40, subject=f"commit {sha}", date="2026-01-01", content=sha)


def _family(check: str, term: str, configs: dict[str, list[int]], failed: int) -> dict:
    return {"check": check, "term": term, "context": "", "label": "", "applied": sum(a for a, _ in configs.values()),
            "failed": failed, "beyond": 0, "known": 0, "configs": configs}


def test_history_tells_one_term_s_fix_and_a_new_defect_in_a_family_that_already_fails() -> None:
    """A fix of the log-prob gradient at TP > 1 is FIXED HERE while the entropy's gradient keeps failing;
    a crash that fails on more configurations is marked where it changes."""
    tp2, tp1 = config_key(parse_case("kernel:tp=2,T=3,v_local=4")), config_key(parse_case("kernel:tp=1,T=3,v_local=8"))
    tp2_bf16 = config_key(parse_case("kernel:tp=2,T=3,v_local=4,dtype=bf16"))
    chunked = config_key(parse_case("kernel:tp=1,T=5,v_local=8,chunk_size=2"))
    two = config_key(parse_case("kernel:tp=1,T=5,v_local=8,context=two_calls"))

    def result(lp_fails: bool, crash_chunked: int) -> dict:
        fams = {"gradients [log-prob]": _family("gradients", "log-prob", {tp2: [3, 3 * lp_fails],
                                                                           tp2_bf16: [2, 2 * lp_fails], tp1: [4, 0]},
                                                 5 * lp_fails),
                "gradients [entropy]": _family("gradients", "entropy", {tp2: [3, 3], tp1: [4, 0]}, 3),
                "crash": _family("crash", "", {two: [2, 1], chunked: [3, crash_chunked]}, 1 + crash_chunked)}
        case = "kernel:tp=2,T=3,v_local=4"
        findings = [{"check": "gradients", "family": key, "term": fams[key]["term"], "case": case, "message": "m",
                     "repro": "r", "shrunk": True, "use": IN_USE} for key in fams if fams[key]["failed"]]
        return {"cases_run": 10, "levels": ["kernel"], "findings": findings, "known_findings": [], "families": fams}

    commits = [_commit("a"), _commit("b"), _commit("c")]
    outcomes = {commits[0].sha: CommitOutcome("checked", result=result(True, 0)),
                commits[1].sha: CommitOutcome("checked", result=result(True, 2)),
                commits[2].sha: CommitOutcome("checked", result=result(False, 2))}
    rows = history_rows(commits, outcomes, "REPO", "T")
    assert rows[1]["cells"]["crash"]["mark"] == "changed" and rows[1]["cells"]["crash"]["started"] == [chunked]
    assert rows[2]["cells"]["gradients [log-prob]"]["mark"] == "fixed"
    assert "mark" not in rows[2]["cells"]["gradients [entropy]"]
    stretches = {t["family"]: t for t in transitions(rows)}
    assert stretches["gradients [log-prob]"]["fixed"] == "c" * 10 and stretches["gradients [entropy]"]["fixed"] is None
    assert stretches["crash"]["changes"][0]["commit"] == "b" * 10
    text = render_markdown({"target": "T", "rows": rows, "repo": "REPO", "paths": ["lp.py"], "profile": "smoke",
                            "tp": [1, 2], "checked": 3, "elapsed_s": 1.0, "transitions": list(stretches.values()),
                            "families": ["gradients [log-prob]", "gradients [entropy]", "crash"]})
    assert f"- log-prob gradients at TP > 1: FAILS ALREADY at `{'a' * 10}`, FIXED HERE on `{'c' * 10}`" in text
    assert "CHANGES HERE" in text and "starts failing in two_calls" not in text and "starts failing with two or more chunks" in text


# A routine whose log-prob gradient misses the normaliser's share (its log-sum-exp detached):
# wrong at TP 1 already, so its script runs in one process.
DETACHED = '''
import torch


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True){detach}
    lp = (x - lse).gather(-1, tokens.reshape(-1, 1).long()).squeeze(-1)
    return lp, None
'''


def test_a_script_runs_without_the_harness_and_exits_1_on_the_defect_0_without(tmp_path) -> None:
    """The script of a gradient finding, run in an interpreter that cannot import this project
    (-I -S: no site, no PYTHONPATH; only torch's folder added, the routine's file given as the
    script's argument), against the defective routine and the fixed one."""
    from harness.targets import load_target

    case = parse_case("kernel:tp=1,T=3,v_local=5,with_entropy=0,with_entropy_grad=0,seed=3")
    site = str(Path(torch.__file__).resolve().parents[1])
    boot = "import runpy, sys; sys.path.append(sys.argv[1]); sys.argv = sys.argv[2:]; " \
           "runpy.run_path(sys.argv[0], run_name='__main__')"
    codes = {}
    for name, detach in (("detached", ".detach()"), ("right", "")):
        spec = _module(tmp_path, name, DETACHED.format(detach=detach))
        script = tmp_path / f"{name}_repro.py"
        scripts.write(load_target(spec), case, "gradients", "log-prob", script)
        assert "harness" not in [line.split()[1].split(".")[0] for line in script.read_text().splitlines()
                                 if line.startswith(("import ", "from "))]
        run = subprocess.run([sys.executable, "-I", "-S", "-c", boot, site, str(script), spec], capture_output=True,
                             text=True, timeout=120, cwd=tmp_path, env={"PATH": os.environ.get("PATH", "")})
        codes[name] = run.returncode
        if name == "detached":
            assert "DEFECT (gradients): rank 0's shard of the log-prob term's gradient is wrong" in run.stdout, run.stderr[-2000:]
    assert codes == {"detached": 1, "right": 0}
    check = subprocess.run([sys.executable, "-I", "-S", "-c", "import sys; sys.path.append(sys.argv[1]); import harness",
                            site], capture_output=True, text=True, timeout=60)
    assert check.returncode != 0 and "No module named 'harness'" in check.stderr


def test_no_script_is_offered_where_it_would_need_the_harness() -> None:
    from harness.targets import load_target

    case = parse_case("kernel:tp=1,T=3,v_local=4")
    assert "part of the harness" in scripts.refusal(load_target("harness.targets.fused"), case, "gradients")
    assert "context" in scripts.refusal(load_target("harness.targets.peers.ms_swift"),
                                        case.replace(context="two_calls"), "gradients")


def test_gate_fails_on_what_fail_on_names() -> None:
    """`--fail-on in-use`: only new findings in the target's use fail; new and any: every new one."""
    inside = Finding("values", "kernel", "kernel:tp=1,T=3,v_local=4", "off", "repro")
    outside = Finding("empty-input", "kernel", "kernel:tp=1,T=0,v_local=4", "raised", "repro", use=BEYOND_USE)
    assert gated([inside, outside], "in-use") == [inside] and gated([outside], "in-use") == []
    assert gated([inside, outside], "new") == gated([inside, outside], "any") == [inside, outside]


def test_check_fail_on_in_use_prints_beyond_use_findings_and_passes(harness_pools, tmp_path, capsys) -> None:
    """A routine whose findings are all beyond its use: `check` exits 1 by default (new findings),
    0 under `--fail-on in-use`, which still prints them."""
    from harness.cli import main

    beyond_all = ROUTINE.replace('{"where": {"T": 0}', '{"where": {}')
    argv = ["check", "--target", _module(tmp_path, "beyond_all", beyond_all), "--tp", "1", "--profile", "smoke", "-q",
            "--no-shrink", "--max-findings", "1"]
    assert main(argv, pools=harness_pools) == 1
    capsys.readouterr()
    assert main(argv + ["--fail-on", "in-use"], pools=harness_pools) == 0
    printed = capsys.readouterr().out
    assert "BEYOND THE TARGET'S USE" in printed and "beyond the target's use: trainer/batches.py:12" in printed
    assert "new finding(s) beyond the target's use: printed, not failing the run (--fail-on in-use)" in printed


def test_pytest_fail_on_in_use_makes_beyond_use_findings_expected_failures(tmp_path) -> None:
    """The pytest route's gate is `check`'s: a test whose findings are all beyond the target's use
    fails by default and is an expected failure, naming them, under `--harness-fail-on in-use`."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CI")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    target = _module(tmp_path, "beyond_all", ROUTINE.replace('{"where": {"T": 0}', '{"where": {}'))

    def suite(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pytest", "--pyargs", "harness.conformance", "-p", "no:cacheprovider",
                               "--harness-target", target, "--harness-tp", "1", "--harness-profile", "smoke",
                               "-k", "test_corpus and empty", "-rx", *extra], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=240)

    default = suite()
    assert default.returncode == 1 and "failed" in default.stdout, default.stdout[-3000:] + default.stderr[-2000:]
    gated_in_use = suite("--harness-fail-on", "in-use")
    assert gated_in_use.returncode == 0 and "xfailed" in gated_in_use.stdout, gated_in_use.stdout[-3000:]
    assert "beyond the target's use (--harness-fail-on in-use): trainer/batches.py:12" in gated_in_use.stdout
