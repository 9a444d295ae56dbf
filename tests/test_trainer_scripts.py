"""Peers' scripts run on the peers' own code (`harness repro --script`): the trainers' steps at the
wrapper level (`verl_loss`, `ms_swift_loss`, `nemo_rl`, `nemo_rl_unpacked`: the step around the
routine, re-typed in a dozen lines over the routine's own file), AReaL's kernel, Liger's fused-linear
JSD and slime's own wrapper (slime #2153's rule). Each shows the defect its adapter finds and nothing
on a clean case, with its trainer's tree on sys.path (skipped without it), in an interpreter that
finds only torch, megatron-core and that tree."""
from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

from harness.base import levels
from harness.checks import script as scripts
from harness.targets import load_target
from tests.test_script import finished, start_script

# (adapter, case, check, term, exit status, what the script says)
RUNS = {
    "verl-chunked-entropy-crash": (
        "verl_loss", "wrapper:tp=1,v_local=4,total_lengths=1/1,response_lengths=0/0,entropy_coef=absent,temperature=absent,"
        "chunk_size=1,with_entropy=1,top_p=none,regime=normal,seed=0", "crash", "", 1,
        "DEFECT (crash): rank 0's backward raised RuntimeError: one of the variables needed for gradient computation "
        "has been modified by an inplace operation"),
    "verl-clean": (
        "verl_loss", "wrapper:tp=1,v_local=16,total_lengths=4/5,response_lengths=2/3,entropy_coef=0.01,temperature=0.7,"
        "chunk_size=-1,with_entropy=1,top_p=none,regime=normal,seed=3", "wrapper-gradients", "", 0,
        "no defect (wrapper-gradients)"),
    "ms-swift-log-prob-gradient": (
        "ms_swift_loss", "wrapper:tp=2,v_local=1,total_lengths=2,response_lengths=1,entropy_coef=absent,temperature=absent,"
        "chunk_size=-1,with_entropy=0,top_p=none,regime=normal,seed=0", "wrapper-gradients", "log-prob", 1,
        "DEFECT (wrapper-gradients): rank 0's shard of the gradient is wrong in packed row(s) [0], whose target it does "
        "not own"),
    "ms-swift-clean": (
        "ms_swift_loss", "wrapper:tp=1,v_local=8,total_lengths=4/5,response_lengths=2/3,entropy_coef=absent,"
        "temperature=0.7,chunk_size=-1,with_entropy=1,top_p=none,regime=normal,seed=3", "temperature", "", 0,
        "no defect (temperature)"),
    "nemo-rl-packed-clean": (
        "nemo_rl", "wrapper:tp=2,v_local=8,total_lengths=4/5,response_lengths=2/3,entropy_coef=absent,temperature=0.7,"
        "chunk_size=2,with_entropy=0,top_p=none,regime=normal,seed=3", "wrapper-gradients", "", 0,
        "no defect (wrapper-gradients)"),
    "nemo-rl-unpacked-clean": (
        "nemo_rl_unpacked", "wrapper:tp=2,v_local=8,total_lengths=4/5,response_lengths=2/3,entropy_coef=absent,"
        "temperature=0.7,chunk_size=2,with_entropy=0,top_p=none,regime=normal,seed=3", "temperature", "", 0,
        "no defect (temperature)"),
    "areal-neginf-entropy": (
        "areal", "kernel:tp=1,T=1,v_local=4,dtype=fp32,regime=neginf,chunk_size=-1,mask=none,with_entropy=1,"
        "with_entropy_grad=1,requires_grad=1,loss_terms=both,seed=2", "finite", "entropy", 1,
        "DEFECT (finite): rank 0's entropy is nan in row(s) [0]"),
    "areal-clean-tp2": (
        "areal", "kernel:tp=2,T=6,v_local=8,dtype=fp32,regime=normal,chunk_size=4,mask=none,with_entropy=1,"
        "with_entropy_grad=1,requires_grad=1,loss_terms=log_prob,seed=5", "gradients", "", 0, "no defect (gradients)"),
    "slime-2153-rule-clean": (
        "slime.backends.megatron_utils.loss", "wrapper:tp=2,v_local=5,total_lengths=6/4,response_lengths=3/2,"
        "entropy_coef=0.0,temperature=absent,chunk_size=-1,with_entropy=1,top_p=none,regime=normal,seed=2153",
        "entropy-coef-rule", "", 0, "no defect (entropy-coef-rule)"),
    "slime-2153-gradients-clean": (
        "slime.backends.megatron_utils.loss", "wrapper:tp=1,v_local=8,total_lengths=6/4,response_lengths=3/2,"
        "entropy_coef=0.0,temperature=0.8,chunk_size=2,with_entropy=1,top_p=nucleus,regime=normal,seed=2153",
        "wrapper-gradients", "entropy", 0, "no defect (wrapper-gradients)"),
    "liger-bf16-soft-loss": (
        "liger_jsd", "linear_distill:tp=1,T=1,H=1,v_local=2,kind=jsd,beta=0.1,dtype=bf16,labels=all,seed=0", "values", "",
        1, "DEFECT (values): the loss is 0.0131226 where 0.0116603 is expected"),
    "liger-fp32-clean": (
        "liger_jsd", "linear_distill:tp=1,T=7,H=5,v_local=40,kind=jsd,beta=0.1,temperature=2.0,chunk_size=3,dtype=fp32,"
        "labels=random,seed=4", "values", "", 0, "no defect (values)"),
}
# The package each adapter's script finds on PYTHONPATH: its tree's root is where that package lies.
PACKAGE = {"verl_loss": "verl", "ms_swift_loss": "swift", "nemo_rl": "nemo_rl", "nemo_rl_unpacked": "nemo_rl",
           "areal": "areal", "liger_jsd": "liger_kernel", "slime.backends.megatron_utils.loss": "slime"}


def _root(package: str) -> Path | None:
    """The sys.path entry that holds a trainer's package (a tree or site-packages), or None."""
    spec = importlib.util.find_spec(package)
    return Path(list(spec.submodule_search_locations)[0]).parent if spec and spec.submodule_search_locations else None


# Found as the session starts: other tests put stand-in trees on sys.path for a while.
ROOTS = {adapter: _root(package) for adapter, package in PACKAGE.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str, int]]:
    """Every script of `RUNS` whose trainer's tree is on sys.path, started at once."""
    tmp = tmp_path_factory.mktemp("trainer_scripts")
    started: dict[str, tuple[subprocess.Popen, int]] = {}
    for name, (adapter, spec, check, term, _, _) in RUNS.items():
        root = ROOTS[adapter]
        if root is None:
            continue
        script = tmp / f"{name}.py"
        target = load_target(adapter if "." in adapter else f"harness.targets.peers.{adapter}")
        scripts.write(target, levels.parse(spec), check, term, script)
        started[name] = start_script(script, root), len(script.read_text().splitlines())
    return finished(started)


@pytest.mark.parametrize("name", RUNS)
def test_a_peer_s_script_shows_its_defect_and_nothing_on_a_clean_case(runs: dict, name: str) -> None:
    if name not in runs:
        pytest.skip(f"{RUNS[name][0]}'s trainer tree is not on sys.path")
    status, stdout, stderr, lines = runs[name]
    assert lines <= scripts.MAX_LINES
    assert (status, RUNS[name][5] in stdout) == (RUNS[name][4], True), stdout[-2000:] + stderr[-2000:]
