"""`harness repro --script` at the KL-estimator level: a script draws the case's own inputs, fits in an
issue for the built-in routine and both KL peers, exits 1 on a mutant's routine and 0 on the built-in
one, and says the cause; OpenRLHF's empty-mask mean is NaN in its script too (skipped without its tree
on sys.path). The routines run are `fused_kl.py` copied out as a file, with a mutant in place."""
from __future__ import annotations

import inspect
import subprocess
from pathlib import Path

import pytest
import torch

from harness.base import levels
from harness.checks import script as scripts
from harness.targets import fused_kl, load_target
from harness.targets.mutants import catalog
from tests.test_script import _mutant_class, finished, start_script


def kl_routine(folder: Path, name: str, mutant: str | None = None) -> Path:
    """`harness/targets/fused_kl.py` (harness-free already) as the file `name`.py of `folder`, its
    `kl_estimate` the built-in routine's or `mutant`'s."""
    folder.mkdir(parents=True, exist_ok=True)
    text = Path(inspect.getfile(fused_kl)).read_text()
    if mutant:
        text += f"\n\n{_mutant_class(mutant)}\n\n\nKL_ROUTINE = {catalog()[mutant].routine.__name__}()\n"
    path = folder / f"{name}.py"
    path.write_text(text + "kl_estimate = KL_ROUTINE.kl_estimate\n")
    return path


@pytest.fixture(scope="module")
def built_in(tmp_path_factory: pytest.TempPathFactory):
    """The built-in routine as a file, loaded once (a module name is loaded once per process)."""
    return load_target(str(kl_routine(tmp_path_factory.mktemp("kl_built_in"), "kl_script_built_in")))


# The longest a script gets: the far tail (a clamp where the target takes one), a random mask, a reduction.
WIDEST = ("kl:tp=1,T=7,kind=k3,reduction=token_mean,regime=fartail,mask=float,clamp=20,seed=1",
          "kl:tp=1,T=7,kind=k1,reduction=none,regime=fartail,mask=random,clamp=20,dtype=bf16,seed=1",
          "kl:tp=1,T=7,kind=k2,reduction=sum,regime=fartail,mask=random,seed=1")


@pytest.mark.parametrize("peer", ("openrlhf", "verl_kl"))
def test_kl_scripts_fit_in_an_issue(tmp_path: Path, built_in, peer: str) -> None:
    """Every check the level writes, on its widest cases, for the built-in routine and both KL peers
    (written without a peer's tree: the script finds it at run time)."""
    for target in (built_in, load_target(f"harness.targets.peers.{peer}")):
        for spec in WIDEST:
            for check in ("values", "gradients", "grad-flags", "finite", "shapes-dtypes"):
                path = tmp_path / f"{check}.py"
                scripts.write(target, levels.parse(spec), check, "", path)
                text = path.read_text()
                compile(text, str(path), "exec")
                assert len(text.splitlines()) <= scripts.MAX_LINES, text
                assert "V_LOCAL" not in text  # no vocabulary at this level


@pytest.mark.parametrize("spec", ("kl:tp=1,T=9,regime=fartail,mask=float,clamp=10,dtype=bf16,seed=3",
                                  "kl:tp=1,T=5,regime=zero,mask=all,reduction=sum,seed=4",
                                  "kl:tp=1,T=12,regime=wide,mask=empty,reduction=token_mean,seed=5"))
def test_a_script_draws_the_case_s_own_inputs(tmp_path: Path, built_in, spec: str) -> None:
    """The script's `inputs()` are the harness's, bit for bit: its tokens are the finding's."""
    case = levels.parse(spec)
    path = tmp_path / "inputs.py"
    scripts.write(built_in, case, "values", "", path)
    ns: dict = {"__name__": "kl_script"}
    exec(compile(path.read_text(), str(path), "exec"), ns)  # noqa: S102 - defines its functions only
    for got, want in zip(ns["inputs"](), case.inputs(), strict=True):
        assert (got is None and want is None) or (got.dtype == want.dtype and torch.equal(got, want))


def test_refusals_say_why() -> None:
    target = load_target("harness.targets.fused")
    assert "part of the harness" in (scripts.refusal(target, levels.parse("kl:tp=1,T=4"), "values") or "")
    assert "T=0" in (scripts.refusal(target, levels.parse("kl:tp=1,T=0"), "values") or "")
    assert "checks" in (scripts.refusal(target, levels.parse("kl:tp=1,T=4"), "crash") or "")


# (routine: None for the built-in one, or a mutant; case; check; exit status; what the script says)
RUNS = {
    "built-in": (None, "kl:tp=1,T=8,kind=k3,reduction=token_mean,regime=fartail,mask=random,clamp=20,seed=5",
                 "gradients", 0, "no defect (gradients)"),
    "empty-mean-nan": ("kl-empty-mean-nan", "kl:tp=1,T=6,kind=k3,mask=empty,reduction=token_mean,seed=7", "finite", 1,
                       "DEFECT (finite): the token mean of the k3 estimate over the valid tokens (a mask with no valid "
                       "token) is not finite (0 of 6 tokens valid): [nan] where [0.0] is expected (a mean over no valid "
                       "token is 0 / 0"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str, int]]:
    """Every script of `RUNS` (and OpenRLHF's, with its tree on sys.path) started at once: exit status,
    stdout, stderr and line count of each."""
    tmp = tmp_path_factory.mktemp("kl_scripts")
    started: dict[str, tuple[subprocess.Popen, int]] = {}
    for name, (mutant, spec, check, _, _) in RUNS.items():
        routine = kl_routine(tmp / name, f"kl_{name.replace('-', '_')}", mutant)
        script = tmp / f"{name}_repro.py"
        scripts.write(load_target(str(routine)), levels.parse(spec), check, "", script)
        started[name] = start_script(script, routine.parent), len(script.read_text().splitlines())
    openrlhf = load_target("harness.targets.peers.openrlhf")
    roots = __import__("harness.targets.peers.openrlhf", fromlist=["SOURCE"]).SOURCE.roots()
    if roots:
        script = tmp / "openrlhf_repro.py"
        scripts.write(openrlhf, levels.parse(RUNS["empty-mean-nan"][1]), "finite", "", script)
        started["openrlhf"] = start_script(script, roots[0]), len(script.read_text().splitlines())
    return finished(started)


@pytest.mark.parametrize("name", RUNS)
def test_a_script_exits_1_on_the_defect_and_0_without_it(runs: dict, name: str) -> None:
    status, stdout, stderr, lines = runs[name]
    assert lines <= scripts.MAX_LINES
    assert (status, RUNS[name][4] in stdout) == (RUNS[name][3], True), stdout[-2000:] + stderr[-2000:]


def test_openrlhf_s_empty_mask_mean_is_nan_in_its_script(runs: dict) -> None:
    if "openrlhf" not in runs:
        pytest.skip("OpenRLHF's tree is not on sys.path")
    status, stdout, stderr, lines = runs["openrlhf"]
    assert lines <= scripts.MAX_LINES
    assert status == 1 and "is not finite (0 of 6 tokens valid): [nan] where [0.0] is expected" in stdout, stdout + stderr
