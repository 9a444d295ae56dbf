"""Level-2 checks of `get_log_probs_and_entropy`, the loss-side wrapper of slime PR #2153.

Named for the level it checks, as `reference/wrapper.py` computes that level and
`targets/mutants/wrapper.py` breaks it: a level keeps one module name across the layers."""
from __future__ import annotations

from typing import Any, cast

import torch

from harness.cases.case import Case, WrapperCase
from harness.checks import Evidence, Explain, check
from harness.checks.common import cp_hint
from harness.checks.problems import ENTROPY, GRADIENT, KEY_OUTPUTS, Problem
from harness.checks.terms import each_term_alone, wrapper_terms
from harness.engine.observations import HARNESS_STEP
from harness.reference.cp import response_positions

MATRIX_COLUMN = "wrapper"  # the peers' matrix shows this module's checks as one column
SAMPLES = ("samples",)  # the evidence of a per-sample wrapper call: this level's own


def _per_sample(ev: Evidence, key: str, what: str) -> list[str]:
    """Every rank's per-sample values against its own expectation (its replica's data, its CP pieces):
    problems about the output `key` names."""
    problems = []
    for r in ev.ranks:
        exp = ev.expected_for(r)
        want, bounds = getattr(exp, key), getattr(exp, f"{key}_tol")
        got = getattr(r.obs, key)
        if want is None or got is None or len(got) != len(want):
            continue  # counted by wrapper-extraction
        for i, (g, w, b) in enumerate(zip(got, want, bounds, strict=True)):
            problems += ev.compare(g, w, b, f"{r.name} sample {i} {what}", KEY_OUTPUTS[key])
    return problems


def at_cp1(case: Any, target: Any) -> dict[str, Case]:
    """At CP > 1, the same case at CP 1 (what a CP finding's explanation compares with)."""
    return {"cp1": case.replace(cp=1, cp_layout="zigzag")} if getattr(case, "cp", 1) > 1 else {}


def _right_at_cp1(ev: Evidence, related: dict[str, Evidence]) -> str:
    """At CP > 1, whether the same case at CP 1 returns the right pieces: then the wrapper returns
    the whole response where it holds a CP rank's piece, as one written without CP does."""
    if "cp1" not in related or extraction(related["cp1"]):
        return ""
    return f"wrong only at CP > 1 (the same case at CP 1 is right): {cp_hint(ev)}"


@check("wrapper-extraction", evidence=SAMPLES, needs="forward", explain=Explain(at_cp1, _right_at_cp1), terms=True)
def extraction(ev: Evidence) -> list[str]:
    """One float32 tensor of R_i response values per sample, for log-probs and (when asked) entropy;
    at CP > 1, of the response positions that the rank's zigzag chunks hold."""
    c = cast(WrapperCase, ev.case)  # evidence "samples": this level's cases
    problems = []
    for r in ev.ranks:
        pieces = [int(v.numel()) for v in ev.expected_for(r).log_prob]
        for key, metas in (("log_probs", r.obs.log_prob_meta), ("entropy", r.obs.entropy_meta)):
            if metas is None:
                if key == "entropy" and c.with_entropy:
                    problems.append(Problem(f"{r.name}: with_entropy=True but res has no 'entropy'", ENTROPY))
                continue
            assert isinstance(metas, list)  # per sample at the wrapper level
            if len(metas) != len(c.response_lengths):
                problems.append(Problem(f"{r.name}: {len(metas)} {key} entries for {len(c.response_lengths)} samples",
                                        KEY_OUTPUTS[key]))
                continue
            for i, (m, n) in enumerate(zip(metas, pieces, strict=True)):
                if m is None:
                    problems.append(Problem(f"{r.name}: {key}[{i}] is not a tensor", KEY_OUTPUTS[key]))
                    continue
                if m.numel != n:
                    what = "response length" if c.cp == 1 else f"this CP rank's piece of the response ({n} of {c.response_lengths[i]})"
                    problems.append(Problem(f"{r.name}: {key}[{i}] has shape {list(m.shape)}, {what} is {n}",
                                            KEY_OUTPUTS[key]))
                if m.dtype != "float32":
                    problems.append(Problem(f"{r.name}: {key}[{i}] dtype {m.dtype}, expected float32", KEY_OUTPUTS[key]))
    # The harness's loss step could not weigh an output by its upstream gradient: that output's count is wrong.
    problems += [Problem(f"{r.name}: {r.error}", KEY_OUTPUTS.get(r.obs.step_refused, ""))
                 for r in ev.ranks if r.error_kind == HARNESS_STEP]
    problems += _per_sample(ev, "log_prob", "log-probs (shifted targets, response rows)")
    return problems


@check("entropy-coef-rule", evidence=SAMPLES, applies=lambda c, t: c.with_entropy, needs=None, reads=("autograd",), terms=True,
       requires=lambda t, cp: None if t.supports("entropy") else "the target computes no entropy "
                                                                 "(HARNESS_CAPABILITIES['entropy'] is False)")
def entropy_coef_rule(ev: Evidence) -> list[str]:
    """slime PR #2153: the wrapper's entropy is differentiable exactly when entropy_coef != 0
    (absent and -0.0 are zero; a negative coefficient is a coefficient), whoever calls it."""
    c = cast(WrapperCase, ev.case)  # evidence "samples": this level's cases
    coef = "absent" if c.entropy_coef is None else repr(c.entropy_coef)
    failed = [r for r in ev.failed_ranks if r.error_kind != HARNESS_STEP]
    if failed:
        # A caller that never sets entropy_coef is a caller too; other crashes are crash's.
        r = failed[0]
        return [f"{r.name}: the wrapper raised with entropy_coef absent (absent means 0): {r.error}"] \
            if c.entropy_coef is None else []
    problems = []
    for r in ev.ranks:
        metas = r.obs.entropy_meta or []
        assert isinstance(metas, list)  # per sample at the wrapper level
        for i, m in enumerate(metas):
            if m is not None and m.requires_grad != c.expects_entropy_grad:
                problems.append(Problem(f"{r.name}: entropy[{i}].requires_grad={m.requires_grad} with "
                                        f"entropy_coef={coef}; expected {c.expects_entropy_grad}", ENTROPY))
                break
    return problems


@check("wrapper-entropy", evidence=SAMPLES, applies=lambda c, t: c.with_entropy and t.supports("entropy"),
       needs="forward", terms=True)
def wrapper_entropy(ev: Evidence) -> list[str]:
    """Per-sample entropy of the unmasked, temperature-scaled softmax on the response rows."""
    return _per_sample(ev, "entropy", "entropy")


@check("temperature", evidence=SAMPLES, applies=lambda c, t: c.temperature not in (None, 1.0), needs="forward",
       terms=True)
def temperature(ev: Evidence) -> list[str]:
    """The logits are divided by args.rollout_temperature before log-probs and entropy."""
    return _per_sample(ev, "log_prob", "log-probs at temperature") + _per_sample(ev, "entropy", "entropy at temperature")


@check("top-p-replay", evidence=SAMPLES, applies=lambda c, t: c.top_p != "none", needs="forward", terms=True)
def top_p_replay(ev: Evidence) -> list[str]:
    """The recorded nucleus masks the log-probs only; rows without one stay unmasked; entropy unmasked."""
    return _per_sample(ev, "log_prob", "log-probs under top-p replay") + _per_sample(ev, "entropy", "entropy (never masked)")


def _gradient_terms(ev: Evidence, related: dict[str, Evidence]) -> str:
    return wrapper_terms(ev, related, wrapper_gradients)


@check("wrapper-gradients", evidence=SAMPLES, applies=lambda c, t: sum(c.response_lengths) > 0, reads=("autograd",),
       explain=Explain(each_term_alone, _gradient_terms), terms=True)
def wrapper_gradients(ev: Evidence) -> list[str]:
    """Gradient w.r.t. the raw logits shard, including the entropy term exactly when entropy_coef != 0;
    in every TP group (each DP replica, each CP rank: the slice of the whole gradient on its rows); in a
    two_inputs context, each call's logits get their own call's gradient."""
    problems = []
    for second in ((False, True) if ev.case.context == "two_inputs" else (False,)):
        for group in ev.groups():
            grad, exp = ev.full_grad(group, second), ev.expected_for(group[0], second)
            where = group[0].group_name
            call = (" (second call)" if second else "") + (f" ({where})" if where else "")
            if grad is None:
                if exp.grad is not None and not exp.grad.any():
                    continue  # a CP rank whose rows the loss does not reach: None is its zero gradient
                problems.append(Problem(f"no gradient reached the logits{call}", GRADIENT))
                continue
            assert exp.grad is not None and exp.grad_tol is not None  # read only in contexts with autograd
            problems += ev.compare(grad, exp.grad, exp.grad_tol, f"grad (all shards){call}", GRADIENT)
    return problems


@check("cp-invariance", evidence=SAMPLES, applies=lambda c, t: c.cp > 1 and sum(c.response_lengths) > 0,
       twin=lambda c: c.replace(cp=1, cp_layout="zigzag") if c.cp > 1 else None, needs="forward",
       requires=lambda t, cp: None if cp > 1 else "compares CP > 1 with CP 1: runs in the CP families (tpN-cpM)",
       terms=True)
def cp_invariance(ev: Evidence) -> list[str]:
    """The same global case at CP 1: every sample's response, re-assembled from the CP ranks' zigzag
    pieces (TP rank 0 of replica 0 at each CP rank), agrees with it within twice the derived bound
    (each side carries its own float32 error)."""
    c = cast(WrapperCase, ev.case)  # evidence "samples": this level's cases
    twin, exp = ev.twins["cp-invariance"], ev.expected
    pieces = [r for r in ev.ranks if r.replica == 0 and r.rank == 0]
    problems = []
    for key in ("log_prob", "entropy"):
        base, bounds = getattr(twin.obs(), key), getattr(exp, f"{key}_tol")
        if base is None or bounds is None or len(base) != len(bounds):
            continue
        for i, (L, R) in enumerate(zip(c.total_lengths, c.response_lengths, strict=True)):
            whole = torch.full((R,), float("nan"), dtype=torch.float64)
            for r in pieces:
                got, pos = getattr(r.obs, key), response_positions(L, R, c.cp, r.cp_rank)
                if got is None or len(got) != len(base):
                    return problems  # no per-sample list to re-assemble: wrapper-extraction's
                if got[i].numel() != len(pos):
                    problems.append(Problem(f"sample {i} {key}: {r.name} returned {got[i].numel()} values where its "
                                            f"zigzag chunks hold {len(pos)} of the {R} response positions: the CP "
                                            f"pieces do not re-assemble into the response", KEY_OUTPUTS[key]))
                    break
                whole[pos] = got[i].detach().to(torch.float64).reshape(-1)
            else:
                if base[i].numel() == R:
                    problems += ev.compare(whole, base[i].to(torch.float64).reshape(-1), 2 * bounds[i],
                                           f"sample {i} {key} (CP {c.cp} {c.cp_layout}, re-assembled) vs CP 1",
                                           KEY_OUTPUTS[key])
    return problems


@check("chunk-size-honoured", evidence=SAMPLES, applies=lambda c, t: c.kernel_comparable and t.kernel is not None)
def chunk_size_honoured(ev: Evidence) -> list[str]:
    """args.log_probs_chunk_size reaches the kernel: where the target kernel's collectives depend on
    the chunk size, the wrapper's forward issues the chunked kernel's sequence, not the unchunked one
    (at CP > 1 on the CP rank's rows; what the wrapper issues after its kernel, the all-gather CP
    redistribution, is left out of the comparison)."""
    problems = []
    for r in ev.ranks:
        if r.obs.kernel_pass is None:
            continue
        chunked, whole = r.obs.kernel_pass.traces[ev.case.chunk_size], r.obs.kernel_pass.traces[-1]
        got = r.trace[: r.obs.n_forward_collectives]
        if chunked != whole and got[:len(whole)] == whole and got[:len(chunked)] != chunked:
            problems.append(f"{r.name}: the wrapper issued the unchunked kernel's {len(whole)} collectives, "
                            f"not the {len(chunked)} of chunk_size={ev.case.chunk_size}: log_probs_chunk_size ignored")
    return problems
