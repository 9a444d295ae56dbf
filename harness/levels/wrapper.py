"""The wrapper level: the loss-side `get_log_probs_and_entropy`, per-sample responses of a packed
batch, slime's `args` knobs and context parallelism (docs/contract.md, docs/context-parallel.md).

Named for its level, as `reference/wrapper.py` is its oracle's math, `checks/wrapper.py` its own
checks and `targets/mutants/wrapper.py` its defects: a level keeps one module name across the layers."""
from __future__ import annotations

from harness.base.levels import Counts, Level, register
from harness.cases.capabilities import fit
from harness.cases.case import WrapperCase
from harness.cases.strategies import wrapper_cases
from harness.checks import oracle
from harness.checks.memory import WrapperMemory
from harness.checks.scripts.wrapper import WRAPPER_SCRIPT
from harness.checks.terms import WRAPPER_TERMS
from harness.engine.executor import run_wrapper
from harness.targets import REQUIRED, WRAPPER, Contract

LEVEL = register(Level(
    name="wrapper",
    case_class=WrapperCase,
    contracts={"wrapper": Contract(
        WRAPPER, ("logits",),
        dict(args=REQUIRED, unconcat_tokens=REQUIRED, total_lengths=REQUIRED, response_lengths=REQUIRED,
             with_entropy=False, non_loss_data=True, top_p_token_ids=None, top_p_token_offsets=None),
        keyword_only=True, optional={"top_p_token_ids": "top_p", "top_p_token_offsets": "top_p"})},
    fit=fit,
    strategy=wrapper_cases,
    run=run_wrapper,
    expected=oracle.wrapper_expected,
    expected_on=oracle.wrapper_on,
    terms=WRAPPER_TERMS,
    memory=WrapperMemory(),
    # Its outputs are judged per sample by its own checks (evidence "samples": `harness.checks.wrapper`).
    script=WRAPPER_SCRIPT,
    evidence=frozenset({"call", "no-grad-call", "samples", "repeatable", "memory", "memory-allowance",
                        "memory-logits", "configured-chunks"}),
    counts=Counts(cases={"smoke": 5, "ci": 40, "thorough": 400}, dp={"ci": 6, "thorough": 80},
                  cp={"smoke": 2, "ci": 8, "thorough": 60}),
))
