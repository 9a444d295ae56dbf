"""The distillation level (docs/distill.md): its float64 oracle against torch's own float64 functions."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from harness.reference import distill as ref


def _rows(seed: int, T: int = 5, V: int = 11, neginf: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s, t = torch.randn(T, V, generator=g, dtype=torch.float64) * 2, torch.randn(T, V, generator=g, dtype=torch.float64) * 2
    if neginf:  # a masked vocabulary: the same entries -inf in both, one entry per row kept
        masked = torch.rand(T, V, generator=g) < 0.4
        masked[:, 0] = False
        s, t = s.masked_fill(masked, -math.inf), t.masked_fill(masked, -math.inf)
    return s, t


@pytest.mark.parametrize("neginf", [False, True])
def test_full_vocabulary_divergences_match_torch(neginf: bool) -> None:
    s, t = _rows(1, neginf=neginf)
    ls, lt = F.log_softmax(s, -1), F.log_softmax(t, -1)
    kl = lambda inp, tgt: F.kl_div(inp, tgt, reduction="none", log_target=True).nan_to_num(0.0).sum(-1)  # noqa: E731
    forward, reverse = kl(ls, lt), kl(lt, ls)
    torch.testing.assert_close(ref.divergence(s, t, kind="forward_kl"), forward, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref.divergence(s, t, kind="reverse_kl"), reverse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref.divergence(s, t, kind="mixed", beta=0.3), 0.3 * forward + 0.7 * reverse,
                               rtol=1e-12, atol=1e-12)
    soft_ce = -(lt.exp() * ls.nan_to_num(neginf=0.0)).sum(-1)
    torch.testing.assert_close(ref.divergence(s, t, kind="soft_ce"), soft_ce, rtol=1e-12, atol=1e-12)
    # The generalized JSD as TRL and ms-swift write it: m = beta p_t + (1 - beta) p_s.
    beta = 0.25
    lm = torch.logsumexp(torch.stack([lt + math.log(beta), ls + math.log(1 - beta)]), dim=0)
    jsd = beta * kl(lm, lt) + (1 - beta) * kl(lm, ls)
    torch.testing.assert_close(ref.divergence(s, t, kind="jsd", beta=beta), jsd, rtol=1e-12, atol=1e-12)
    # KL(p, p) = 0 for every divergence but the soft cross-entropy (the entropy, there).
    for kind in ("forward_kl", "reverse_kl", "jsd", "mixed"):
        torch.testing.assert_close(ref.divergence(s, s, kind=kind), torch.zeros(s.shape[0], dtype=torch.float64),
                                   rtol=0, atol=1e-12)


def test_topk_gather_and_log_softmax_match_torch() -> None:
    s, _ = _rows(2, V=13)
    torch.testing.assert_close(ref.log_softmax(s, 0.7), F.log_softmax(s / 0.7, -1), rtol=1e-14, atol=1e-14)
    values, ids = ref.topk(s, 4)
    want = torch.topk(F.log_softmax(s, -1), 4)
    torch.testing.assert_close(values, want.values, rtol=1e-14, atol=1e-14)
    assert ids.shape == (5, 4) and ref.topk(s, 99)[1].shape == (5, 13)  # k beyond V: the whole row
    torch.testing.assert_close(ref.topk_threshold(s, 4), torch.topk(s, 4).values[:, -1], rtol=0, atol=0)
    torch.testing.assert_close(ref.gather(s, ids), F.log_softmax(s, -1).gather(-1, ids), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(ref.gather(s, ids, renormalize=True), F.log_softmax(s.gather(-1, ids), -1),
                               rtol=1e-14, atol=1e-14)


def test_ties_break_toward_the_lower_id() -> None:
    x = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]])
    assert ref.topk(x, 2)[1].tolist() == [[1, 2]]
    assert ref.topk_threshold(x, 4).item() == 1.0


def test_top_k_support_renormalized_or_not() -> None:
    s, t = _rows(3, V=9)
    lp_t, ids = ref.topk(t, 3)
    # Renormalized: both teacher and student restricted to the teacher's top-k.
    ps, pt = F.softmax(s.gather(-1, ids), -1), F.softmax(t.gather(-1, ids), -1)
    want = (pt * (pt.log() - ps.log())).sum(-1)
    torch.testing.assert_close(ref.divergence(s, t, k=3), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref.divergence(s, teacher_log_probs=lp_t, teacher_ids=ids), want, rtol=1e-12,
                               atol=1e-12)
    # Not renormalized: the whole vocabulary's probabilities at the support (verl's top-k KL).
    ls_full = F.log_softmax(s, -1).gather(-1, ids)
    want = (lp_t.exp() * (lp_t - ls_full)).sum(-1)
    torch.testing.assert_close(ref.divergence(s, teacher_log_probs=lp_t, teacher_ids=ids, renormalize=False), want,
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ref.KINDS)
def test_gradients_are_finite_at_a_masked_vocabulary(kind: str) -> None:
    """Terms with both probabilities 0 have no gradient, and none turns NaN."""
    s, t = _rows(4, neginf=True)
    s, t = s.requires_grad_(), t.requires_grad_()
    ref.divergence(s, t, kind=kind, beta=0.4).sum().backward()
    assert s.grad is not None and t.grad is not None
    assert torch.isfinite(s.grad).all() and torch.isfinite(t.grad).all()
    assert (s.grad[s.detach() == -math.inf] == 0).all()
    # Against torch's own: forward KL's student gradient is p_s - p_t.
    if kind == "forward_kl":
        torch.testing.assert_close(s.grad, F.softmax(s.detach(), -1) - F.softmax(t.detach(), -1), rtol=1e-12,
                                   atol=1e-12)


def test_an_infinite_divergence_where_the_student_has_no_mass() -> None:
    s = torch.tensor([[0.0, -math.inf]], dtype=torch.float64)
    t = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    assert ref.divergence(s, t, kind="forward_kl").item() == math.inf
    assert ref.divergence(s, t, kind="reverse_kl").item() == pytest.approx(math.log(2))


# ---------------------------------------------------------------------------- cases, loader, fitting
from hypothesis import given, settings  # noqa: E402

from harness.base.levels import fit  # noqa: E402
from harness.base.options import DEFAULT_TARGET  # noqa: E402
from harness.cases.case import DISTILL_REGIMES, DIVERGENCES, DistillCase, parse_case  # noqa: E402
from harness.cases.strategies import distill_cases  # noqa: E402
from harness.targets import from_namespace, load_target  # noqa: E402

CONTROL = "tests.controls.distill_autograd"


def test_kinds_are_the_oracles_and_specs_parse_back() -> None:
    assert DIVERGENCES == ref.KINDS
    case = DistillCase(tp=4, T=3, v_local=5, kind="jsd", teacher="given", k=7, beta=0.25, renormalize=False,
                       dtype="bf16", regime="ties", chunk_size=2, seed=3, layout="col_strided")
    assert parse_case(case.spec()) == case
    with pytest.raises(ValueError, match="jsd needs 0 < beta < 1"):
        case.replace(beta=1.0)
    with pytest.raises(ValueError, match="teacher's pass"):
        case.replace(function="topk")


@pytest.mark.parametrize("regime", ["normal", "ties", "neginf", "disjoint", "fartail"])
def test_inputs_do_not_depend_on_tp(regime: str) -> None:
    a = DistillCase(tp=4, T=6, v_local=4, regime=regime, seed=5).inputs()
    b = DistillCase(tp=1, T=6, v_local=16, regime=regime, seed=5).inputs()
    for x, y in ((a.student, b.student), (a.teacher, b.teacher), (a.topk_ids, b.topk_ids), (a.weights, b.weights)):
        assert torch.equal(x, y)
    assert torch.isfinite(a.student).any(-1).all()  # every row keeps a finite entry


def test_neginf_pads_the_vocabulary_tail_and_topk_support_has_no_boundary_tie() -> None:
    x = DistillCase(tp=4, T=5, v_local=4, regime="neginf", seed=2).inputs().student
    assert (x[:, 12:] == -math.inf).all()  # the last shard at TP 4: the padded tail
    assert (x[1::2, 8:] == -math.inf).all()  # and every other row's last half: the last shard at TP 2
    case = DistillCase(tp=2, T=8, v_local=6, teacher="topk", k=3, regime="ties", seed=4)
    t = case.inputs().teacher.to(torch.float64)
    top = t.sort(-1, descending=True).values
    assert (top[:, 2] > top[:, 3]).all()  # no tie at the k-th place where the routine picks the support


def test_strategy_draws_every_function_kind_teacher_and_regime() -> None:
    seen: dict[str, set] = {"function": set(), "kind": set(), "teacher": set(), "regime": set(), "tp": set()}
    flags = set()

    @settings(max_examples=150, derandomize=True, database=None)
    @given(distill_cases())
    def draw(case: DistillCase) -> None:
        for k, values in seen.items():
            values.add(getattr(case, k))
        flags.update(f for f in ("teacher_grad", "self_teacher") if getattr(case, f))
        flags.update({case.context, "beyond" if case.k > case.v_local else "within"})
    draw()
    assert seen["function"] == {"divergence", "log_softmax", "topk", "gather"}
    assert seen["kind"] == set(DIVERGENCES) and seen["teacher"] == {"full", "topk", "given"}
    assert seen["regime"] == set(DISTILL_REGIMES) and seen["tp"] == {1, 2, 4}
    assert flags >= {"teacher_grad", "self_teacher", "no_grad", "beyond", "within"}


def test_a_target_with_some_functions_is_fitted_to_them() -> None:
    import types

    def distill_divergence(student_logits, tp_group, *, teacher_logits=None, teacher_topk_log_probs=None,
                           teacher_topk_indices=None, k=0, kind="forward_kl", beta=0.5, temperature=1.0,
                           renormalize=True, chunk_size=-1):
        raise AssertionError("not called")

    ns = types.SimpleNamespace(distill_divergence=distill_divergence, distill_topk=lambda logits: None,
                               HARNESS_CAPABILITIES={"full_teacher": False, "jsd": False, "temperature": False})
    target = from_namespace("probe", ns)
    assert target.levels == ("distill",) and set(target.distill) == {"divergence"}
    assert "distill topk" in target.not_checked  # a signature the contract cannot call
    case = fit(DistillCase(tp=2, T=3, v_local=4, function="topk", requires_grad=False), target.supports)
    assert isinstance(case, DistillCase) and case.function == "divergence"
    fitted = fit(DistillCase(tp=2, T=3, v_local=4, kind="jsd", temperature=0.7), target.supports)
    assert isinstance(fitted, DistillCase)
    assert (fitted.teacher, fitted.kind, fitted.temperature) == ("topk", "forward_kl", 1.0)
    assert "distill" in load_target(DEFAULT_TARGET).levels


# ---------------------------------------------------------------------------- the tolerance, in one process
def _worst(target: str, case: DistillCase) -> dict[str, float]:
    """Error / bound of the output and the student's gradient, one rank (tp_group=None)."""
    from harness.checks.oracle import expected
    from harness.engine.calls import DistillShard

    shard = DistillShard.of(case, 0, torch.device("cpu"))
    out, _ = shard.call(load_target(target), case, None)
    exp = expected(case)
    ratio = lambda a, b, tol: ((a.double() - b).abs() / tol).nan_to_num(0.0).max().item()  # noqa: E731
    worst = {"values": ratio(out, exp.log_prob, exp.log_prob_tol)}
    loss = shard.loss(out)
    if isinstance(loss, torch.Tensor) and exp.grad is not None:
        loss.backward()
        worst["grad"] = ratio(shard.grad(), exp.grad, exp.grad_tol)
    return worst


TOLERANCE_CASES = [
    DistillCase(tp=1, T=6, v_local=40, kind="jsd", beta=0.3, seed=1),
    DistillCase(tp=1, T=6, v_local=40, kind="reverse_kl", teacher="given", k=8, renormalize=False, dtype="bf16", seed=2),
    DistillCase(tp=1, T=6, v_local=40, function="log_softmax", temperature=0.7, seed=3),
    DistillCase(tp=1, T=6, v_local=40, function="gather", k=9, renormalize=False, seed=4),
    DistillCase(tp=1, T=6, v_local=40, kind="soft_ce", teacher="topk", k=5, regime="neginf", seed=5),
]


@pytest.mark.parametrize("case", TOLERANCE_CASES, ids=lambda c: c.group())
def test_the_bound_separates_correct_routines_from_bf16_sums(case: DistillCase) -> None:
    """Derived, not tuned: two correct float32 algorithms well inside the bound, a bf16 sum of
    exponentials over the vocabulary outside it (docs/distill.md, Tolerance). A support renormalized
    over itself sums no exponential over the vocabulary (the mutant's step), hence the exception."""
    for target in (DEFAULT_TARGET, CONTROL):
        assert max(_worst(target, case).values()) < 0.6, target
    if case.teacher != "topk":
        assert _worst("mutant:distill-bf16-sum-exp", case)["values"] > 2


# ---------------------------------------------------------------------------- on the pools
DISTILL_CHECKS = ("values", "gradients", "grad-flags", "shapes-dtypes", "finite", "crash", "hang", "collectives",
                  "chunk-invariance", "tp-invariance", "input-integrity", "empty-input", "inference-path",
                  "side-effects", "divergence-self-zero", "memory-no-vocab-gather")


@pytest.mark.distributed
@pytest.mark.parametrize("target", [DEFAULT_TARGET, CONTROL])
def test_builtin_and_control_are_clean_at_tp_1_2_4(harness_pools, target: str) -> None:
    from harness.driver.explorer import explore, run_corpus
    from harness.driver.runner import Runner

    runner = Runner(target, collective_timeout_s=10, pools=harness_pools)
    findings = run_corpus(runner, [1, 2, 4], levels=["distill"])
    findings += explore(runner, "distill", [1, 2, 4], 36, seed=45, shrink=False)
    assert not findings, [f"{f.check} {f.case}: {f.message[:300]}" for f in findings]
    stats = runner.verdicts.stats
    assert {n for n in DISTILL_CHECKS if n != "hang" and not stats[(n, "distill")].applied} == set()
    assert max(stats[("values", "distill")].margins) < 0.5


@pytest.mark.distributed
def test_distill_mutants_killed_by_their_checks(harness_pools) -> None:
    from harness.commands.mutate import CLEAN, kill_matrix, run_catalog
    from harness.targets.mutants import catalog

    names = [n for n, m in catalog().items() if "distill" in m.levels]
    assert len(names) >= 16
    # The budget holds the covering draw (one case per combination the contract names, 29) and random
    # cases besides: a chunked half-precision case, which the float32 upcast needs, is one of those.
    results = run_catalog(names, [1, 2, 4], harness_pools, budget=40, collective_timeout_s=6, include_clean=False)
    assert not [r.name for r in results if r.name != CLEAN and not r.ok], kill_matrix(results)
