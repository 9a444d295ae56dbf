"""Context parallelism (docs/context-parallel.md): TP x CP worlds, the per-CP-rank oracle, and the
built-in routine and the controls at CP 2 and 4 under both layouts with no finding."""
from __future__ import annotations

import pytest

from harness.cases.case import WrapperCase, parse_case
from harness.cases.corpus import CORPUS
from harness.driver.runner import Runner

pytestmark = pytest.mark.distributed

CONTROLS = ("unshifted", "online", "gather", "twopass_pairwise", "inplace_grad", "autograd_collective")


def _cases(tp: int, cp: int, layout: str) -> list[WrapperCase]:
    base = dict(tp=tp, v_local=5, total_lengths=(6, 4), response_lengths=(3, 2), seed=7, cp=cp, cp_layout=layout)
    variants = (
        dict(top_p="partial", entropy_coef=0.0),  # top-p replay, metric-only entropy
        dict(entropy_coef=0.5, chunk_size=2, temperature=0.7),  # chunked, differentiable entropy
        # a prompt of 1, a response of 0, a sample shorter than 2 * cp, under no_grad
        dict(total_lengths=(1, 2, 9), response_lengths=(0, 1, 8), entropy_coef=-0.01, context="no_grad"),
        dict(total_lengths=(8,), response_lengths=(1,), entropy_coef=1.0),  # the response on one rank's chunk
    )
    return [WrapperCase(**{**base, **v}) for v in variants]


def test_cp_fields_keep_existing_specs_and_round_trip():
    case = WrapperCase(tp=2, v_local=3, total_lengths=(4,), response_lengths=(2,))
    assert "cp" not in case.spec()
    cp = case.replace(cp=2, cp_layout="allgather")
    assert cp.spec().endswith(",cp=2,cp_layout=allgather") and parse_case(cp.spec()) == cp
    assert cp.args().allgather_cp and not case.replace(cp=2).args().allgather_cp


def test_pool_world_is_tp_x_cp_in_megatron_order(harness_pools):
    pool = Runner("harness.targets.fused", pools=harness_pools).pool(2, cp=2)
    # (world rank, TP rank, CP rank, DP rank, CP size, CP group size, sum of the CP group's world ranks)
    assert pool.run("tests.pool_jobs:cp_layout") == [(0, 0, 0, 0, 2, 2, 2), (1, 1, 0, 0, 2, 2, 4),
                                                     (2, 0, 1, 0, 2, 2, 2), (3, 1, 1, 0, 2, 2, 4)]


@pytest.mark.parametrize("layout", ["zigzag", "allgather"])
@pytest.mark.parametrize("tp,cp", [(1, 2), (2, 2)])
def test_builtin_routine_passes_at_cp(harness_pools, tp, cp, layout):
    runner = Runner("harness.targets.fused", pools=harness_pools)
    for case in _cases(tp, cp, layout):
        ev, findings = runner.check(case)
        assert not findings, [f.message[:300] for f in findings]
        assert {r.cp_rank for r in ev.ranks} == set(range(cp))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zigzag", "allgather"])
@pytest.mark.parametrize("tp", [1, 2])
def test_builtin_routine_passes_at_cp4(harness_pools, tp, layout):
    runner = Runner("harness.targets.fused", pools=harness_pools)
    for case in _cases(tp, 4, layout):
        _, findings = runner.check(case)
        assert not findings, [f.message[:300] for f in findings]


@pytest.mark.slow
@pytest.mark.parametrize("name", CONTROLS)
def test_controls_pass_at_cp_2_and_4(harness_pools, name):
    runner = Runner(f"tests.controls.{name}", pools=harness_pools)
    for tp, cp in ((1, 2), (2, 2), (1, 4)):
        for layout in ("zigzag", "allgather"):
            for case in _cases(tp, cp, layout):
                _, findings = runner.check(case)
                assert not findings, [f.message[:300] for f in findings]


def test_memory_checks_hold_each_cp_rank_to_its_own_rows(harness_pools):
    # The unit is a rank's own rows (T_local x V_local): a rank that computes every CP rank's rows
    # exceeds the built-in's budget, which the clean routine keeps on every CP rank.
    case = next(e.case for e in CORPUS if e.name == "cp-memory-per-rank")
    clean = Runner("harness.targets.fused", pools=harness_pools)
    assert not clean.check(case)[1]
    assert clean.verdicts.stats[("memory-budget", "wrapper")].applied == 1
    assert clean.verdicts.stats[("memory-backward-frees", "wrapper")].applied == 1
    _, findings = Runner("mutant:cp-gathered-logits", pools=harness_pools).check(case)
    assert [f.check for f in findings] == ["memory-budget"], [f.message[:300] for f in findings]
    assert findings[0].message.startswith("rank 0 (cp 0, tp 0): retained "), findings[0].message[:300]
    assert "x T_local*V_local*4 (T_local = 32 rows of CP 2)" in findings[0].message


def test_chunk_size_is_checked_on_each_cp_rank_and_the_memory_comparison_says_why_not(harness_pools):
    # NeMo-RL #2871 at all-gather CP: the wrapper's collectives, its redistribution left out, are the
    # unchunked kernel's on that rank's rows.
    case = next(e.case for e in CORPUS if e.name == "cp-wrapper-chunk-size")
    clean = Runner("harness.targets.fused", pools=harness_pools)
    assert not clean.check(case)[1]
    assert clean.verdicts.stats[("chunk-size-honoured", "wrapper")].applied == 1
    notes = clean.verdicts.stats[("memory-chunk-passthrough", "wrapper")].not_applied
    assert any("CP > 1" in n for n in notes), notes
    _, findings = Runner("mutant:chunk-size-ignored", pools=harness_pools).check(case)
    assert [f.check for f in findings] == ["chunk-size-honoured"], [f.message[:300] for f in findings]
    assert "rank 0 (cp 1, tp 0): the wrapper issued the unchunked kernel's" in findings[0].message


CP_MUTANTS = ("cp-absent-piece-requires-grad", "zigzag-offset-off-by-one", "cp-reduce-over-tp-group",
              "cp-reduce-over-world", "top-p-mask-wrong-cp-layout", "world-rank-as-tp-rank", "cp-gathered-logits")


@pytest.mark.slow
def test_cp_mutants_are_killed_by_the_checks_they_name(harness_pools):
    from harness.commands.mutate import kill_matrix, run_catalog

    results = run_catalog(list(CP_MUTANTS), [1, 2, 4], harness_pools, budget=10, collective_timeout_s=6,
                          include_clean=False)
    assert all(r.ok for r in results), kill_matrix(results)
