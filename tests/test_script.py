"""`harness repro --script`: a finding as one stand-alone script, at every level, run where only torch
and the routine's own folder can be imported: exit 1 while the defect is there, 0 on the routine
without it. The routines are the built-in ones copied out as files (the harness's own are refused),
with a mutant of the catalog in place of the routine for the defect."""
from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from harness.base import levels
from harness.checks import script as scripts
from harness.targets import fused, fused_distill, fused_kl, fused_linear, fused_linear_distill, load_target
from harness.targets.mutants import catalog

SITE = str(Path(torch.__file__).resolve().parents[1])  # torch's folder, and no site: no harness


def _mutant_class(name: str) -> str:
    """A mutant's class as source, without its registration."""
    source = textwrap.dedent(inspect.getsource(catalog()[name].routine))
    return "\n".join(source.splitlines()[ast.parse(source).body[0].lineno - 1:])


def built_in(folder: Path, name: str, mutant: str | None = None) -> Path:
    """`harness/targets/fused.py` as the file `name`.py of `folder`, harness-free: the three modules it
    imports beside it, its declaration left out; with `mutant`'s routine in place of its own."""
    folder.mkdir(parents=True, exist_ok=True)
    for module in (fused_distill, fused_kl, fused_linear, fused_linear_distill):
        (folder / Path(inspect.getfile(module)).name).write_text(Path(inspect.getfile(module)).read_text())
    text = Path(inspect.getfile(fused)).read_text()
    lines = text.splitlines()
    declared = [n for n in ast.parse(text).body
                if isinstance(n, ast.ImportFrom) and n.module == "harness.targets.declaration"
                or isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "HARNESS" for t in n.targets)]
    for node in sorted(declared, key=lambda n: -n.lineno):
        del lines[node.lineno - 1:node.end_lineno]
    text = "\n".join(lines).replace("from harness.targets.", "from ") + "\n"
    if mutant:
        cls = catalog()[mutant].routine
        text += (f"\n\nFused = FusedLogProbEntropy\n\n\n{_mutant_class(mutant)}\n\n\nROUTINE = {cls.__name__}()\n"
                 "calculate_log_probs_and_entropy = ROUTINE.calculate_log_probs_and_entropy\n"
                 "get_log_probs_and_entropy = ROUTINE.get_log_probs_and_entropy\n")
    path = folder / f"{name}.py"
    path.write_text(text)
    return path


def distill_built_in(folder: Path, name: str, mutant: str | None = None) -> Path:
    """`harness/targets/fused_distill.py` (harness-free already) as the file `name`.py of `folder`, its
    four functions bound to the built-in routine or to `mutant`'s."""
    folder.mkdir(parents=True, exist_ok=True)
    text = Path(inspect.getfile(fused_distill)).read_text()
    if mutant:
        text += f"\n\n{_mutant_class(mutant)}\n\n\nDISTILL_ROUTINE = {catalog()[mutant].routine.__name__}()\n"
    text += "".join(f"{f} = DISTILL_ROUTINE.{f}\n"
                    for f in ("distill_log_softmax", "distill_topk", "distill_gather", "distill_divergence"))
    path = folder / f"{name}.py"
    path.write_text(text)
    return path


def start_script(script: Path, routine_folder: Path) -> subprocess.Popen:
    """The script in an interpreter that finds only torch and the routine's folder (PYTHONPATH; no
    site, so not the harness's editable install either), from the script's own folder."""
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join([str(routine_folder), SITE])}
    return subprocess.Popen([sys.executable, "-S", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=script.parent, env=env)


def finished(started: dict[str, tuple[subprocess.Popen, int]]) -> dict[str, tuple[int, str, str, int]]:
    """Each started script's exit status, stdout, stderr and line count, once it ends."""
    out = {}
    for name, (run, lines) in started.items():
        stdout, stderr = run.communicate(timeout=300)
        out[name] = run.returncode, stdout, stderr, lines
    return out


# (copy, mutant, case, check, term, what the finding says)
FINDINGS = {
    "kernel-values": (
        built_in, "mask-applied-to-entropy", "kernel:tp=1,T=4,v_local=6,mask=random,seed=2", "values", "entropy",
        "DEFECT (values): rank 0's entropy is wrong in row(s)"),
    "wrapper-extraction": (
        built_in, "shift-off-by-one", "wrapper:tp=1,v_local=8,total_lengths=4/5,response_lengths=2/3,seed=1",
        "wrapper-extraction", "", "DEFECT (wrapper-extraction): rank 0's log-prob of sample 0 is wrong"),
    "distill-values": (
        distill_built_in, "distill-bf16-sum-exp", "distill:tp=1,T=4,v_local=64,function=divergence,seed=3", "values",
        "", "DEFECT (values): rank 0's output is wrong in row(s)"),
    "distill-gradients-tp2": (
        distill_built_in, "distill-grad-sum-not-reduced", "distill:tp=2,T=3,v_local=8,function=log_softmax,seed=3",
        "gradients", "", "DEFECT (gradients): rank 1's shard of the student's gradient is wrong"),
    "distill-given-teacher": (
        distill_built_in, "distill-given-temperature-ignored",
        "distill:tp=1,T=4,v_local=8,teacher=given,k=4,renormalize=1,temperature=0.7,seed=3", "values", "",
        "DEFECT (values): rank 0's output is wrong in row(s)"),
    "memory-logits-dtype": (
        built_in, "chunked-grad-buffer-float32", "kernel:tp=1,T=8,v_local=16,dtype=bf16,chunk_size=2,seed=1",
        "memory-logits-dtype", "", "rank 0's backward allocates a float32 buffer of all 8x16 bf16 logits"),
}


@pytest.mark.parametrize("finding", FINDINGS, ids=list(FINDINGS))
def test_a_script_exits_1_on_the_defect_and_0_on_the_routine_without_it(tmp_path: Path, finding: str) -> None:
    copy, mutant, spec, check, term, message = FINDINGS[finding]
    case = levels.parse(spec)
    runs = {}
    for kind, name in (("defect", mutant), ("right", None)):
        routine = copy(tmp_path / kind, f"script_{finding.replace('-', '_')}_{kind}", name)
        script = tmp_path / f"{kind}_repro.py"
        assert scripts.write(load_target(str(routine)), case, check, term, script) == [script]
        text = script.read_text()
        assert len(text.splitlines()) <= scripts.MAX_LINES, text
        assert str(tmp_path) not in text  # the routine is found on PYTHONPATH, not at this machine's path
        assert not any(line.split()[1].split(".")[0] in scripts.HARNESS_PACKAGES for line in text.splitlines()
                       if line.startswith(("import ", "from ")))
        runs[kind] = start_script(script, routine.parent)
    out = {kind: run.communicate(timeout=300) for kind, run in runs.items()}
    assert message in out["defect"][0], out["defect"][0][-3000:] + out["defect"][1][-3000:]
    assert {kind: run.returncode for kind, run in runs.items()} == {"defect": 1, "right": 0}, out["right"]


def test_a_routine_file_given_as_the_argument_is_the_one_run(tmp_path: Path) -> None:
    """Without PYTHONPATH, the routine's file is the script's first argument."""
    routine = built_in(tmp_path / "routine", "script_argument_fused", "mask-applied-to-entropy")
    script = tmp_path / "repro.py"
    scripts.write(load_target(str(routine)), levels.parse(FINDINGS["kernel-values"][2]), "values", "entropy", script)
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": SITE}
    run = subprocess.run([sys.executable, "-S", str(script), str(routine)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=env)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    missing = subprocess.run([sys.executable, "-S", str(script)], capture_output=True, text=True, timeout=300,
                             cwd=tmp_path, env=env)
    assert missing.returncode == 2 and "could not run" in missing.stdout
    harness = subprocess.run([sys.executable, "-S", "-c", "import harness"], capture_output=True, text=True,
                             timeout=60, cwd=tmp_path, env=env)
    assert harness.returncode != 0  # the scripts above ran without the harness on the path


def test_a_wrapper_script_hands_over_every_field_of_the_harness_s_args(tmp_path: Path) -> None:
    """A trainer's wrapper reads its `args` by attribute (slime's `args.allgather_cp`): the script's `ARGS`
    holds every field the harness hands over, at its value, at every check."""
    routine = load_target(str(built_in(tmp_path, "script_args_fused")))
    case = levels.parse("wrapper:tp=1,v_local=4,total_lengths=4/5,response_lengths=2/3,entropy_coef=0.0,temperature=0.7,"
                        "chunk_size=2,with_entropy=1")
    for check in scripts.level_script(case).checks:
        if check == scripts.MEMORY:
            continue  # float32 logits: refused
        path = tmp_path / f"args_{check}.py"
        scripts.write(routine, case, check, "", path)
        settings = next(line for line in path.read_text().splitlines() if line.startswith("TOTAL_LENGTHS"))
        names, values = settings.split(" = ", 1)
        args = ast.literal_eval(values)[names.split(", ").index("ARGS")]
        assert args == vars(scripts.script_case(case, check, "").args()), check


def test_refusals_name_what_a_script_cannot_hand_over(tmp_path: Path) -> None:
    routine = load_target(str(built_in(tmp_path, "script_refused_fused")))
    distill = load_target(str(distill_built_in(tmp_path, "script_refused_distill")))

    def why(target, spec: str, check: str) -> str:
        return scripts.refusal(target, levels.parse(spec), check) or ""

    assert "part of the harness" in why(load_target("harness.targets.fused"), "kernel:tp=1,T=3,v_local=4", "values")
    wrapper_cp = "wrapper:tp=1,v_local=4,total_lengths=4/5,response_lengths=2/3,cp=2"
    assert "cp=1" in why(routine, wrapper_cp, "wrapper-gradients")
    assert "contiguous" in why(routine, "kernel:tp=1,T=3,v_local=4,layout=transposed", "values")
    assert "checks" in why(distill, "distill:tp=1,T=8,v_local=8,dtype=bf16,chunk_size=2", "memory-logits-dtype")
    assert "float32 logits" in why(distill, "distill:tp=1,T=4,v_local=8,teacher=given,dtype=bf16", "values")
    with pytest.raises(ValueError, match="training path"):
        scripts.write(routine, levels.parse("kernel:tp=1,T=3,v_local=4,context=no_grad"), "values", "",
                      tmp_path / "x.py")


# A case per level, at TP 2 with bf16 chunks (a memory script's case) and in float32 (every other's).
PEER_CASES = {
    "kernel": ("kernel:tp=2,T=8,v_local=16,dtype=bf16,chunk_size=2,seed=1",
               "kernel:tp=2,T=6,v_local=5,mask=random,chunk_size=4,seed=1",
               "kernel:tp=1,T=8,v_local=16,dtype=bf16,chunk_size=2,seed=1"),  # TP 1: a non-tensor-parallel peer's
    "wrapper": ("wrapper:tp=2,v_local=8,total_lengths=4/5,response_lengths=2/3,seed=1",),
    "linear": ("linear:tp=1,T=8,H=8,v_local=16,dtype=bf16,chunk_size=2,seed=1", "linear:tp=1,T=4,H=8,v_local=4,seed=1"),
    "distill": ("distill:tp=2,T=4,v_local=8,kind=jsd,temperature=0.9,seed=7",
                "distill:tp=2,T=4,v_local=8,function=log_softmax,seed=1",
                "distill:tp=2,T=4,v_local=8,teacher=given,k=4,renormalize=0,seed=3"),
    "linear_distill": ("linear_distill:tp=1,T=6,H=4,v_local=9,chunk_size=2,hard_weight=0.5,soft_weight=0.5,seed=1",),
    "kl": ("kl:tp=1,T=8,kind=k3,reduction=token_mean,mask=random,dtype=bf16,seed=1",
           "kl:tp=1,T=8,kind=k1,reduction=none,regime=fartail,clamp=20.0,seed=2"),
}
PEERS_WITH_SCRIPTS = ("ms_swift", "ms_swift_gkd", "nemo_rl", "skyrl_fused_linear", "verl", "verl_chunked",
                      "verl_fused_linear", "skyrl", "megatron", "megatron_fused", "trl", "prime_rl", "cce", "nemo_rl_distill",
                      "skyrl_mtp", "verl_distill", "openrlhf", "verl_kl", "trl_gkd", "megatron_rl", "torchtune_kd", "liger_jsd", "openrlhf_loss",
                      "verl_loss", "ms_swift_loss", "nemo_rl_unpacked", "areal")


@pytest.mark.parametrize("peer", PEERS_WITH_SCRIPTS)
def test_a_peer_s_scripts_fit_in_an_issue(tmp_path: Path, peer: str) -> None:
    """Every script a peer adapter declares, at every check of its levels, is at most MAX_LINES lines
    (written without the peer's tree: the script finds it at run time)."""
    target = load_target(f"harness.targets.peers.{peer}")
    written = 0
    for level, specs in PEER_CASES.items():
        for spec in specs:
            case = levels.parse(spec)
            level_script = scripts.level_script(case)
            for check in level_script.checks if level_script else ():
                path = tmp_path / f"{level}_{check}.py"
                try:
                    scripts.write(target, case, check, "", path)
                except ValueError:  # refused: the reason is `refusal`'s, tested above
                    continue
                written += 1
                assert len(path.read_text().splitlines()) <= scripts.MAX_LINES, path.read_text()
    assert written


def test_a_non_tensor_parallel_peer_s_scripts_run_at_tp_1(tmp_path: Path) -> None:
    """TRL is not tensor-parallel: at TP > 1 the adapter gathers the shards, not TRL, so its scripts
    are written at TP 1 only and a TP 2 finding is refused, saying why."""
    target = load_target("harness.targets.peers.trl")
    assert "not tensor-parallel" in (scripts.refusal(target, levels.parse("kernel:tp=2,T=4,v_local=4"), "values") or "")
    assert scripts.refusal(target, levels.parse("kernel:tp=1,T=4,v_local=4"), "values") is None


# Peers installed beside the harness (their scripts import them from site-packages, as a maintainer's
# environment would): (peer, case, check, term, exit status, what the script says).
INSTALLED_PEERS = {
    "trl-neginf-entropy": ("trl", "kernel:tp=1,T=6,v_local=8,regime=neginf,with_entropy=1,seed=1", "finite", "entropy",
                           1, "DEFECT (finite): rank 0's entropy is nan in row(s)"),
    "megatron-clean": ("megatron", "kernel:tp=2,T=6,v_local=5,with_entropy=0,seed=1", "gradients", "", 0,
                       "no defect (gradients)"),
}


@pytest.mark.parametrize("finding", INSTALLED_PEERS, ids=list(INSTALLED_PEERS))
def test_an_installed_peer_s_script_runs_without_the_harness(tmp_path: Path, finding: str) -> None:
    peer, spec, check, term, status, message = INSTALLED_PEERS[finding]
    script = tmp_path / f"{peer}_repro.py"
    scripts.write(load_target(f"harness.targets.peers.{peer}"), levels.parse(spec), check, term, script)
    assert len(script.read_text().splitlines()) <= scripts.MAX_LINES
    run = start_script(script, tmp_path)
    out, err = run.communicate(timeout=300)
    assert (run.returncode, message in out) == (status, True), out[-2000:] + err[-2000:]
