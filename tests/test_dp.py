"""TP groups inside a larger world (DP x TP), as in training: a routine that reduces over the
default group instead of its TP group must fail, never pass silently."""
from __future__ import annotations

import pytest

from harness.base import levels
from harness.cases.case import KernelCase, WrapperCase, parse_case
from harness.cases.profiles import PROFILES
from harness.commands.mutate import run_catalog
from harness.driver.explorer import plan
from harness.driver.runner import Runner

pytestmark = pytest.mark.distributed

WORLD_GROUP = "mutant:world-group-reduce"


def test_dp_field_keeps_existing_specs_and_round_trips():
    case = KernelCase(tp=2, T=3, v_local=4)
    assert "dp=" not in case.spec()  # specs (and test ids) of DP-1 cases unchanged
    two = case.replace(dp=2)
    assert two.spec().endswith(",dp=2") and parse_case(two.spec()) == two
    assert two.replica(0) == two and two.replica(1).seed != two.seed
    assert two.replica(1).replace(seed=two.seed) == two  # same shapes and settings, other data


def test_pool_world_is_dp_replicas_of_the_tp_group(harness_pools):
    runner = Runner("harness.targets.fused", pools=harness_pools)
    pool = runner.pool(2, dp=2)
    assert pool.world == 4
    # Megatron-core's own layout: TP groups of contiguous ranks, the TP group a subgroup of the world.
    assert pool.run("tests.pool_jobs:layout") == [(0, 0, 0, 2, 4), (1, 1, 0, 2, 4), (2, 0, 1, 2, 4), (3, 1, 1, 2, 4)]
    assert pool.run("tests.pool_jobs:tp_sum") == [3.0, 3.0, 7.0, 7.0]


def test_builtin_routine_passes_inside_a_larger_world(harness_pools):
    runner = Runner("harness.targets.fused", pools=harness_pools)
    for case in (KernelCase(tp=2, T=5, v_local=4, mask="random", chunk_size=2, dp=2, seed=3),
                 WrapperCase(tp=2, v_local=3, total_lengths=(4, 3), response_lengths=(2, 1), entropy_coef=0.0,
                             chunk_size=2, dp=2, seed=5)):
        ev, findings = runner.check(case)
        assert not findings, [f.message[:300] for f in findings]
        # Every TP group is judged, each against the oracle of its own replica's data.
        assert [(r.replica, r.rank) for r in ev.ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_world_group_reduce_passes_when_world_is_tp_and_fails_in_dp(harness_pools):
    """The blind spot of world == TP: the same case passes at DP 1 and fails at DP 2."""
    runner = Runner(WORLD_GROUP, pools=harness_pools)
    case = KernelCase(tp=2, T=4, v_local=3, seed=11)
    _, findings = runner.check(case)
    assert not findings
    _, findings = runner.check(case.replace(dp=2))
    assert "values" in {f.check for f in findings}
    assert "dp=2" in next(f for f in findings if f.check == "values").repro


def test_world_group_reduce_is_killed_by_the_default_run(harness_pools):
    results = run_catalog(["world-group-reduce"], [1, 2, 4], harness_pools, budget=20, collective_timeout_s=6)
    mutant = next(r for r in results if r.name == "world-group-reduce")
    assert mutant.ok and "values" in mutant.fired
    assert "dp=2" in mutant.fired["values"].case


def test_ci_profile_explores_tp2_inside_a_world_of_4_and_thorough_beyond_4():
    counts = levels.get("kernel").counts
    steps = plan(PROFILES["ci"], ("kernel", "wrapper"), [1, 2, 4])
    assert ("kernel", [2], counts.dp["ci"], 2, 1) in steps
    assert all(dp == 1 for *_, dp, _cp in steps[:2])
    thorough = plan(PROFILES["thorough"], ("kernel",), [1, 2, 4])
    per_size = counts.cases["thorough"]
    assert thorough[:2] == [("kernel", [1, 2, 4], 3 * per_size, 1, 1),
                            ("kernel", [3, 8], 2 * round(per_size * PROFILES["thorough"].extra_tp_share), 1, 1)]
    assert plan(PROFILES["thorough"], ("kernel",), [8])[:2] == [("kernel", [8], per_size, 1, 1),
                                                             ("kernel", [3], round(per_size / 4), 1, 1)]
    assert plan(PROFILES["ci"], ("kernel",), [2], launched=True) == [("kernel", [2], counts.cases["ci"], 1, 1)]


@pytest.mark.parametrize("tp", [3, 8])
def test_builtin_routine_at_tp_3_and_8(harness_pools, tp):
    """The thorough profile's sizes: a non-power of two, and 8 ranks on CPU with small cases."""
    runner = Runner("harness.targets.fused", pools=harness_pools)
    for case in (KernelCase(tp=tp, T=3, v_local=2, mask="random", chunk_size=2, seed=tp),
                 WrapperCase(tp=tp, v_local=2, total_lengths=(3,), response_lengths=(2,), entropy_coef=0.5, seed=tp)):
        _, findings = runner.check(case)
        assert not findings, [f.message[:300] for f in findings]
    _, findings = Runner("mutant:missing-allreduce-max", pools=harness_pools).check(
        KernelCase(tp=tp, T=3, v_local=2, seed=tp))
    assert "values" in {f.check for f in findings}
