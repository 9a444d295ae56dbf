"""The fused-linear distillation level (docs/linear-distill.md): its float64 reference, its cases, a
correct control of another formulation drawing no finding, and each of its mutants killed by the check
meant for it."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from harness.cases.linear_distill import IGNORE_INDEX, LD_KINDS, LinearDistillCase
from harness.reference import linear_distill as ref

CONTROL = "tests.controls.linear_distill_full"


def _logits(seed: int, T: int = 6, V: int = 9) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s, t = (2 * torch.randn(T, V, generator=g, dtype=torch.float64) for _ in range(2))
    labels = torch.randint(0, V, (T,), generator=g)
    labels[::3] = IGNORE_INDEX
    return s, t, labels


def test_reference_divergences_are_the_textbook_ones() -> None:
    s, t, labels = _logits(0)
    keep = labels != IGNORE_INDEX
    n = int(keep.sum())
    ls, lt = s.log_softmax(-1), t.log_softmax(-1)
    kl = lambda p, q: (p.exp() * (p - q)).sum(-1)  # noqa: E731
    beta = 0.3
    m = torch.log(beta * lt.exp() + (1 - beta) * ls.exp())
    want = {"forward_kl": kl(lt, ls), "reverse_kl": kl(ls, lt), "soft_ce": -(lt.exp() * ls).sum(-1),
            "jsd": beta * kl(lt, m) + (1 - beta) * kl(ls, m)}
    for kind in LD_KINDS:
        got = ref.loss_of_logits(s, t, labels, kind, beta)
        torch.testing.assert_close(got, want[kind][keep].sum() / n, rtol=1e-12, atol=1e-12)
    # GKD's JSD (its mixture in log space) is the contract's at the same beta.
    lm = torch.logsumexp(torch.stack([ls + math.log(1 - beta), lt + math.log(beta)]), 0)
    gkd = beta * F.kl_div(lm, lt, reduction="none", log_target=True).sum(-1) \
        + (1 - beta) * F.kl_div(lm, ls, reduction="none", log_target=True).sum(-1)
    torch.testing.assert_close(ref.loss_of_logits(s, t, labels, "jsd", beta), gkd[keep].sum() / n)


def test_reference_hard_loss_is_cross_entropy_at_temperature_one_and_the_mean_is_the_batch_s() -> None:
    s, t, labels = _logits(1)
    ce = F.cross_entropy(s, labels, ignore_index=IGNORE_INDEX)
    soft = ref.loss_of_logits(s, t, labels, "forward_kl", temperature=2.0)
    both = ref.loss_of_logits(s, t, labels, "forward_kl", temperature=2.0, hard_weight=0.4, soft_weight=0.6)
    torch.testing.assert_close(both, 0.4 * ce + 0.6 * soft, rtol=1e-12, atol=1e-12)
    none = torch.full_like(labels, IGNORE_INDEX)
    assert ref.loss_of_logits(s, t, none, "jsd", hard_weight=0.5, soft_weight=0.5) == 0
    assert ref.loss_of_logits(s, s, labels, "reverse_kl").abs() < 1e-15  # KL(p, p) = 0


def test_cases_parse_back_and_refuse_what_the_level_is_not() -> None:
    from harness.base import levels

    case = LinearDistillCase(tp=1, T=7, H=3, v_local=11, kind="jsd", beta=0.9, temperature=0.7, hard_weight=0.3,
                             soft_weight=0.7, chunk_size=3, dtype="bf16", teacher="logits", labels="random",
                             regime="disjoint", seed=5)
    assert levels.parse(case.spec()) == case
    inp = case.inputs()
    assert inp.teacher_weight is None and inp.teacher_hidden.shape == (7, 11)
    assert inp.student_hidden.dtype == torch.bfloat16 and (inp.labels != IGNORE_INDEX).any()
    for bad, match in ((dict(tp=2), "tp=1"), (dict(kind="jsd", beta=0.0), "beta"), (dict(chunk_size=0), "chunk")):
        with pytest.raises(ValueError, match=match):
            LinearDistillCase(**{**dict(tp=1, T=3, H=2, v_local=4), **bad})


# ---------------------------------------------------------------------------- on the pools
LD_CHECKS = ("values", "gradients", "grad-flags", "shapes-dtypes", "finite", "crash", "input-integrity",
             "side-effects", "chunk-invariance")


@pytest.mark.distributed
@pytest.mark.parametrize("target", ["harness.targets.fused", CONTROL])
def test_builtin_and_control_are_clean(harness_pools, target: str) -> None:
    from harness.driver.explorer import explore
    from harness.driver.runner import Runner

    runner = Runner(target, collective_timeout_s=10, pools=harness_pools)
    findings = explore(runner, "linear_distill", [1], 30, seed=13, shrink=False)
    assert not findings, [f"{f.check} {f.case}: {f.message[:300]}" for f in findings]
    stats = runner.verdicts.stats
    assert {n for n in LD_CHECKS if not stats[(n, "linear_distill")].applied} == set()
    assert max(stats[("values", "linear_distill")].margins) < 0.5


@pytest.mark.distributed
def test_linear_distill_mutants_killed_by_their_checks(harness_pools) -> None:
    from harness.commands.mutate import CLEAN, kill_matrix, run_catalog
    from harness.targets.mutants import catalog

    names = [n for n, m in catalog().items() if m.levels == ("linear_distill",)]
    assert len(names) >= 6
    results = run_catalog(names, [1], harness_pools, budget=40, collective_timeout_s=6, include_clean=False)
    assert not [r.name for r in results if r.name != CLEAN and not r.ok], kill_matrix(results)


# ---------------------------------------------------------------------------- scripts
def _routine(folder, name: str, defect: tuple[str, str] | None = None):
    """The built-in routine as a module of its own (it imports torch only), with one line replaced."""
    from pathlib import Path

    from harness.targets import fused_linear_distill

    text = Path(fused_linear_distill.__file__).read_text() + \
        "\nlinear_distill_loss = LINEAR_DISTILL_ROUTINE.linear_distill_loss\n"
    if defect is not None:
        assert defect[0] in text
        text = text.replace(*defect)
    path = folder / f"{name}.py"
    path.write_text(text)
    return path


SCRIPTED = (  # (check, case, the defect put in a copy of the built-in routine, the cause its script names)
    ("values", "T=7,H=3,v_local=11,kind=jsd,beta=0.9,temperature=0.7,hard_weight=0.3,soft_weight=0.7,chunk_size=3,"
     "dtype=fp32,teacher=logits,labels=random,regime=normal,seed=5",
     ("return keep.sum().clamp(min=1).to(torch.float32)", "return torch.tensor(float(max(keep.numel(), 1)))"),
     "divided by all T tokens"),
    ("finite", "T=5,H=3,v_local=7,kind=forward_kl,hard_weight=0.5,soft_weight=0.5,chunk_size=2,labels=empty,"
     "regime=peaked,seed=9",
     ("return keep.sum().clamp(min=1).to(torch.float32)", "return keep.sum().to(torch.float32)"), "0 / 0"),
)


def test_a_script_names_the_cause_and_exits_0_without_the_defect(tmp_path) -> None:
    """Each script, run in its own interpreter (all at once), exits 1 on the copy with the defect, saying
    its cause, and 0 on the copy without it."""
    import subprocess
    import sys

    from harness.base import levels
    from harness.checks import script as scripts
    from harness.targets import load_target

    runs = []
    for check, spec, defect, cause in SCRIPTED:
        case = levels.parse(f"linear_distill:tp=1,{spec}")
        for name, change, want in ((f"ld_good_{check}", None, 0), (f"ld_bad_{check}", defect, 1)):
            routine = _routine(tmp_path, name, change)
            path = tmp_path / f"{name}_repro.py"
            scripts.write(load_target(str(routine)), case, check, "", path)
            assert len(path.read_text().splitlines()) <= scripts.MAX_LINES
            proc = subprocess.Popen([sys.executable, str(path), str(routine)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=tmp_path)
            runs.append((proc, want, cause))
    for proc, want, cause in runs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == want, out + err
        assert want == 0 or cause in out, out


def test_the_corpus_keeps_a_one_rank_level_s_cases_at_tp_1() -> None:
    """At TP sizes without 1, a corpus case moves to the largest, unless its level runs on one rank."""
    from harness.driver.explorer import corpus_cases

    cases = dict(corpus_cases(["linear_distill", "kernel"], [2, 4]))
    assert cases["ld-per-chunk-mean"].tp == 1 and cases["odd-vocab-tp2"].tp in (2, 4)


def test_a_script_s_loss_bound_holds_for_conforming_routines_and_not_for_bf16_arithmetic(tmp_path, monkeypatch) -> None:
    """The values script's loss bound (first order in each logit's rounding) is no false finding: over
    the level's covering draw at eight seeds (fp32 and bf16, V up to 200) the built-in routine and the
    independent control stay within half of it; and it can fail: a copy of the built-in routine that
    keeps the chunk's logits in bf16 (the divergence's arithmetic in bf16, as Liger's) goes beyond it.
    Each script runs in this process, its functions called."""
    import sys
    from pathlib import Path

    from harness.base import levels
    from harness.cases.linear_distill import linear_distill_cover
    from harness.checks import script as scripts
    from harness.targets import load_target

    controls = Path(__file__).parent / "controls"
    routines = {"built-in": _routine(tmp_path, "ld_bound_built_in"), "control": controls / "linear_distill_full.py",
                "bf16 arithmetic": _routine(tmp_path, "ld_bound_bf16", ("return (hidden @ weight.T).float()",
                                                                         "return hidden @ weight.T"))}
    for folder in (tmp_path, controls):
        monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setattr(sys, "argv", ["bound_check"])  # a script reads a routine file from its argument
    worst = {name: 0.0 for name in routines}
    for case in [c for seed in range(1, 9) for c in linear_distill_cover([1], seed, 40)]:
        for name, routine in routines.items():
            target = load_target(str(routine))
            path = tmp_path / f"bound_{routine.stem}.py"
            scripts.write(target, levels.fit(case, target.supports), "values", "", path)
            ns: dict = {"__name__": "bound_check"}
            exec(compile(path.read_text(), str(path), "exec"), ns)
            got = ns["run"](ns["routine"](), 0, None)["out"].double()
            hs, ws, ht, wt, labels, _ = ns["inputs"]()
            x = [v.double() for v in (hs, ws, ht, wt)]
            worst[name] = max(worst[name], float((got - ns["reference"](*x, labels)).abs() / ns["bound"](x, labels, hs.dtype)))
    assert (worst["built-in"] < 0.5, worst["control"] < 0.5, worst["bf16 arithmetic"] > 1) == (True, True, True), worst
