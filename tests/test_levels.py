"""A level is a unit: the registry's contract (`harness.base.levels`), and a fifth level built from
docs/architecture.md's recipe (tests/levels/logsumexp.py) that runs through the shared code with no
edit to it: checks reach it by their evidence, the explorer draws it, the oracle checks judge it
through its judge, and a defect in it is found and shrunk."""
from __future__ import annotations

import pytest

from harness.base import levels
from harness.checks import all_checks
from harness.driver.explorer import explore, plan
from harness.driver.runner import Runner
from harness.targets import load_target


@pytest.fixture
def probe_level():
    import tests.levels.logsumexp as probe
    levels.register(probe.LEVEL)  # again after an earlier test took it out (the module is imported once)
    yield probe.LEVEL
    levels.unregister(probe.NAME)


def test_every_builtin_level_is_registered_with_its_own_case_class():
    found = levels.all_levels()
    assert tuple(found)[:len(levels.BUILTIN)] == levels.BUILTIN
    for name, level in found.items():
        assert level.case_class.level == name and level.contracts and level.counts.cases


def test_a_level_whose_case_class_says_another_name_is_refused():
    kernel = levels.get("kernel")
    with pytest.raises(ValueError, match="case class"):
        levels.register(levels.Level(**{**kernel.__dict__, "name": "not-kernel"}))


def test_a_target_of_one_level_only_loads_for_every_level():
    """A module with only one level's functions (any one of the distillation level's) is a target of that level."""
    from harness.targets import from_namespace, fused
    for name, level in levels.all_levels().items():
        for key, contract in level.contracts.items():
            ns = type("NS", (), {contract.name: staticmethod(getattr(fused, contract.name))})
            target = from_namespace(f"only-{key}", ns)
            assert target.levels == (name,) and target.routine(name, key) is not None


def test_checks_reach_a_new_level_by_its_evidence(probe_level):
    reach = {name for name, chk in all_checks().items() if probe_level.name in chk.levels}
    assert {"values", "gradients", "finite", "tp-invariance", "chunk-invariance", "crash", "hang",
            "collectives", "side-effects", "input-integrity"} <= reach
    assert not reach & {"wrapper-extraction", "memory-logits-dtype", "memory-budget"}  # evidence it does not give
    assert plan(__import__("harness.cases.profiles", fromlist=["PROFILES"]).PROFILES["ci"], (probe_level.name,), [1, 2]) \
        == [(probe_level.name, [1, 2], 24, 1, 1)]


@pytest.mark.distributed
def test_a_new_level_runs_clean_and_finds_its_defect(probe_level, harness_pools):
    good = Runner("tests.levels.lse_routine", collective_timeout_s=6, pools=harness_pools)
    assert load_target("tests.levels.lse_routine").levels == (probe_level.name,)
    assert explore(good, probe_level.name, [1, 2], 12, seed=0) == []
    assert good.verdicts.stats[("values", probe_level.name)].applied > 0
    assert good.verdicts.stats[("tp-invariance", probe_level.name)].applied > 0
    broken = Runner("tests.levels.lse_broken", collective_timeout_s=6, pools=harness_pools)
    findings = explore(broken, probe_level.name, [1, 2], 12, seed=0)
    values = next(f for f in findings if f.check == "values")
    assert values.shrunk and "tp=2" in values.case and values.level == probe_level.name
