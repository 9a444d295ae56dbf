"""What `harness check` prints for a newcomer: each failing check's shrunk finding first, the rest
folded; mismatches in the quantity's units; which loss term a wrong gradient comes from; which TP
size a corpus case ran at; and no warnings at all from the main job."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness.cases.case import KernelCase, WrapperCase
from harness.checks.findings import Finding
from harness.checks.tolerance import compare
from harness.driver.explorer import run_corpus
from harness.driver.runner import Runner
from harness.report.console import finding_blocks

REPO = Path(__file__).resolve().parents[1]


def _finding(check: str, T: int, shrunk: bool = False) -> Finding:
    return Finding(check, "kernel", f"kernel:tp=2,T={T},v_local=4", f"{check} message", "repro line", shrunk=shrunk)


def test_each_check_prints_its_shrunk_finding_first_and_folds_the_rest():
    findings = [_finding("values", 9), _finding("gradients", 8), _finding("values", 7),
                _finding("gradients", 1, shrunk=True), _finding("values", 1, shrunk=True)]
    blocks = finding_blocks(findings, "out.json")
    assert blocks[0].startswith("\nFINDING [values] (kernel) shrunk, start from this one: kernel:tp=2,T=1,")
    assert blocks[1].startswith("  and 2 more [values] finding(s) on other cases (in full in out.json):")
    assert "kernel:tp=2,T=9," in blocks[1] and "kernel:tp=2,T=7," in blocks[1] and "message" not in blocks[1]
    assert blocks[2].startswith("\nFINDING [gradients] (kernel) shrunk: kernel:tp=2,T=1,")  # one start per run
    assert blocks[3].startswith("  and 1 more [gradients]")
    assert sum("start from this one" in b for b in blocks) == 1
    late = finding_blocks([_finding("finite", 3), _finding("values", 1, shrunk=True)])
    assert late[0].startswith("\nFINDING [values] (kernel) shrunk, start from this one:")  # shrunk first
    assert late[1].startswith("\nFINDING [finite] (kernel) kernel:tp=2,T=3,")
    unshrunk = finding_blocks([_finding("values", 5)])  # --no-shrink: no label, nothing folded
    assert unshrunk == ["\nFINDING [values] (kernel) kernel:tp=2,T=5,v_local=4\n  values message\n  repro: repro line"]


def test_a_mismatch_leads_with_the_worst_element_in_the_quantitys_units():
    expected = torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64)
    actual = expected + torch.tensor([0.0, 0.471, 1e-7], dtype=torch.float64)
    problems, worst = compare(actual, expected, torch.full((3,), 2e-6, dtype=torch.float64), "rank 0 log_prob")
    assert problems == ["rank 0 log_prob: worst at [1]: actual -1.529, expected -2, |error| 0.471 > bound 2e-06; "
                        "1 of 3 element(s) outside the bound (33.3%)"]
    assert worst == pytest.approx(0.471 / 2e-6)
    nan = compare(torch.tensor([float("nan"), -2.0]), expected[:2], torch.full((2,), 1e-6), "entropy")[0]
    assert nan == ["entropy: not finite at [0]: actual nan, expected -1; 1 of 2 element(s) outside the bound (50%)"]
    assert compare(expected.clone(), expected, torch.full((3,), 1e-9), "same") == ([], 0.0)


def test_a_corpus_case_run_at_another_tp_size_says_so():
    said = []
    runner = SimpleNamespace(target=SimpleNamespace(levels=("kernel",)), check=lambda case: (None, []),
                             explain=lambda fs: fs, has_run=lambda case: False)
    run_corpus(runner, [1, 2], said.append)
    assert "corpus empty-batch-tp4 (ran at TP 2: its TP 4 was not asked for): ok" in said
    assert "corpus odd-vocab-tp2: ok" in said


@pytest.mark.distributed
def test_a_gradient_finding_names_the_wrong_term(harness_pools):
    runner = Runner("mutant:entropy-grad-sign", pools=harness_pools)
    cases = {
        KernelCase(tp=1, T=3, v_local=4): "the entropy term's gradient is wrong: the same case fails with "
                                          "loss_terms=entropy and passes with loss_terms=log_prob; grad (all shards)",
        KernelCase(tp=1, T=3, v_local=4, loss_terms="entropy"): "the entropy term's gradient is wrong (the only "
                                                                "term in this loss: loss_terms=entropy)",
        WrapperCase(tp=1, v_local=4, total_lengths=(4, 3), response_lengths=(2, 2), entropy_coef=0.5):
            "the entropy term's gradient is wrong: the same case with the log-prob term alone (with_entropy=0) passes",
    }
    for case, words in cases.items():
        check = "gradients" if case.level == "kernel" else "wrapper-gradients"
        _, findings = runner.check(case, only={check})
        (finding,) = runner.explain(findings)
        assert finding.message.startswith(words), finding.message
    # A wrapper that keeps the entropy differentiable at entropy_coef 0 puts an entropy term in the
    # harness's loss, which weighs every differentiable output: not a wrong log-prob gradient.
    ignored = Runner("mutant:coef-ignored", pools=harness_pools)
    case = WrapperCase(tp=1, v_local=4, total_lengths=(4, 3), response_lengths=(2, 2), entropy_coef=0.0)
    _, findings = ignored.check(case, only={"wrapper-gradients"})
    (finding,) = ignored.explain(findings)
    assert finding.message.startswith("the entropy came back differentiable with entropy_coef 0 or absent"), \
        finding.message


def _quiet(argv: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-m", "harness", *argv], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    noise = [line for line in (run.stdout + run.stderr).splitlines() if "Warning" in line or "warn(" in line]
    assert not noise, "\n".join(noise[:10])


@pytest.mark.distributed
def test_the_main_job_prints_no_warning():
    """The smoke profile of the main job, and the case that warned (a wrapper's kernel pass on
    non-leaf logits read `.grad` of a non-leaf tensor, once per worker process)."""
    _quiet(["check", "--profile", "smoke"])
    _quiet(["repro", "wrapper:tp=2,v_local=4,total_lengths=5/3,response_lengths=2/1,entropy_coef=0.5,chunk_size=2,"
                     "layout=nonleaf"])
