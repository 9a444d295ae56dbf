"""How the token levels' outputs are judged against the float64 oracle: the kernel's
`calculate_log_probs_and_entropy`, and the fused-linear `calculate_linear_log_probs_and_entropy`
(docs/fused-linear.md), whose gradients are two: the hidden states' (the same full gradient on every
rank) and the weight shard's. Each level's object (`harness.levels`) holds its judge; the oracle
checks (`harness.checks.outputs`) ask the case's level for it.

Named for the level it judges, as `reference/kernel.py` computes that level, `targets/mutants/kernel.py`
breaks it and `levels/kernel.py` declares it: a level keeps one module name across the layers."""
from __future__ import annotations

from typing import Any

import torch

from harness.checks import Evidence
from harness.checks.problems import ENTROPY, GRADIENT, KEY_OUTPUTS, LOG_PROB, Problem
from harness.checks.terms import kernel_terms

_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class TokenJudge:
    """The kernel level's judging: one log-prob and one entropy per token, the logits' gradient."""

    def grad_shapes(self, c: Any) -> dict[str, tuple[tuple[int, ...], str]]:
        """What each rank's gradients must be: name -> (shape, what the dtype follows)."""
        return {"grad": ((c.T, c.v_local), "the logits'")}

    def values(self, ev: Evidence) -> list[str]:
        problems = []
        for r in ev.ranks:  # every DP replica against the oracle of its own data
            exp = ev.expected_for(r)
            assert isinstance(exp.log_prob, torch.Tensor) and isinstance(exp.log_prob_tol, torch.Tensor)  # not per sample
            problems += ev.compare(r.obs.log_prob, exp.log_prob, exp.log_prob_tol, f"{r.name} log_prob", LOG_PROB)
            if isinstance(exp.entropy, torch.Tensor) and isinstance(exp.entropy_tol, torch.Tensor) \
                    and r.obs.entropy is not None:
                problems += ev.compare(r.obs.entropy, exp.entropy, exp.entropy_tol, f"{r.name} entropy", ENTROPY)
        return problems

    def gradient_terms(self, ev: Evidence, related: dict[str, Evidence]) -> str:
        """Which loss term a wrong gradient comes from, from the case with each term alone."""
        return kernel_terms(ev, related, self.gradients)

    def gradients(self, ev: Evidence) -> list[str]:
        problems = []
        for second in ((False, True) if ev.case.context == "two_inputs" else (False,)):
            for group in ev.groups():
                exp, where = ev.expected_for(group[0], second), group[0].group_name
                call = (" (second call)" if second else "") + (f" ({where})" if where else "")
                problems += self.group_gradients(ev, group, second, exp, call)
        return problems

    def group_gradients(self, ev: Evidence, group: list, second: bool, exp: Any, call: str) -> list[str]:
        grad = ev.full_grad(group, second)
        if grad is None:
            return [Problem(f"no gradient reached the logits{call} (log_prob is not differentiable)", GRADIENT)]
        assert exp.grad is not None and exp.grad_tol is not None  # the check applies to cases with a backward
        return ev.compare(grad, exp.grad, exp.grad_tol, f"grad (all shards){call}", GRADIENT)

    def grad_flags(self, ev: Evidence) -> list[str]:
        c: Any = ev.case
        problems = []
        for r in ev.ranks:
            lp, ent = r.obs.log_prob_meta, r.obs.entropy_meta
            assert not isinstance(lp, list) and not isinstance(ent, list)  # one tensor each at these levels
            if lp and lp.requires_grad != c.grad_on:
                problems.append(Problem(f"rank {r.rank}: log_prob.requires_grad={lp.requires_grad}, "
                                        f"inputs' requires_grad={c.requires_grad}, context {c.context}", LOG_PROB))
            if c.with_entropy and ent is None:
                problems.append(Problem(f"rank {r.rank}: with_entropy=True but entropy is None", ENTROPY))
            if not c.with_entropy and ent is not None:
                problems.append(Problem(f"rank {r.rank}: with_entropy=False but an entropy tensor was returned", ENTROPY))
            if ent is not None and c.with_entropy and ent.requires_grad != c.expects_entropy_grad:
                problems.append(Problem(
                    f"rank {r.rank}: entropy.requires_grad={ent.requires_grad}, expected {c.expects_entropy_grad} "
                    f"(with_entropy_grad={c.with_entropy_grad}, inputs' requires_grad={c.requires_grad}, "
                    f"context {c.context})", ENTROPY))
        return problems

    def shapes_dtypes(self, ev: Evidence) -> list[str]:
        c: Any = ev.case
        want_grad_dtype = _DTYPE_NAMES[c.dtype]
        problems = []
        for r in ev.ranks:
            for key, meta in (("log_prob", r.obs.log_prob_meta), ("entropy", r.obs.entropy_meta)):
                if meta is None:
                    continue
                assert not isinstance(meta, list)  # one tensor at these levels
                shape = meta.shape
                if meta.numel != c.T or len(shape) > 2 or (len(shape) == 2 and shape[1] != 1):
                    problems.append(Problem(f"rank {r.rank}: {key} shape {list(shape)}, expected [{c.T}] or [{c.T}, 1]",
                                            KEY_OUTPUTS[key]))
                if meta.dtype != "float32":
                    problems.append(Problem(f"rank {r.rank}: {key} dtype {meta.dtype}, expected float32", KEY_OUTPUTS[key]))
            for key, (shape, whose) in self.grad_shapes(c).items():
                g = getattr(r.obs, f"{key}_meta")
                if g is None:
                    continue
                if g.dtype != want_grad_dtype:
                    problems.append(Problem(f"rank {r.rank}: {key} dtype {g.dtype}, expected {want_grad_dtype} "
                                            f"({whose} dtype)", GRADIENT))
                if g.shape != shape:
                    problems.append(Problem(f"rank {r.rank}: {key} shape {list(g.shape)}, expected {list(shape)}", GRADIENT))
        return problems

    def finite(self, ev: Evidence) -> list[str]:
        exp = ev.expected
        pairs = [("log_prob", LOG_PROB, ev.obs().log_prob, exp.log_prob), ("entropy", ENTROPY, ev.obs().entropy, exp.entropy),
                 ("grad", GRADIENT, ev.full_grad(), exp.grad)]
        pairs += [(f"rank {r.rank} grad_hidden", GRADIENT, r.obs.grad_hidden, exp.grad_hidden) for r in ev.ranks]
        problems = []
        for name, output, got, want in pairs:
            if not isinstance(got, torch.Tensor) or want is None or got.numel() != want.numel():
                continue
            bad = torch.isfinite(want) & ~torch.isfinite(got.reshape(want.shape).to(torch.float64))
            if bad.any():
                idx = bad.nonzero()[0].tolist()
                problems.append(Problem(f"{name}: {int(bad.sum())} non-finite entries where the oracle is finite, "
                                        f"first at {idx}", output))
        return problems

    def outputs_match(self, ev: Evidence, other: Evidence, what: str) -> list[str]:
        """The same case another way within twice the bound (both sides carry their own float32 error);
        a NaN both ways agrees here (whether it should be there is `finite`'s)."""
        exp = ev.expected
        problems = []
        for key, bound in (("log_prob", exp.log_prob_tol), ("entropy", exp.entropy_tol)):
            a, b = getattr(ev.obs(), key), getattr(other.obs(), key)
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(bound, torch.Tensor) \
                    and b.numel() == bound.numel():
                problems += ev.compare(a, b.to(torch.float64).reshape(bound.shape), 2 * bound, f"{key} vs {what}",
                                       KEY_OUTPUTS[key], equal_nan=True)
        pairs = [("grad", ev.full_grad(), other.full_grad(), exp.grad_tol),
                 ("grad_hidden", ev.obs().grad_hidden, other.obs().grad_hidden, exp.grad_hidden_tol)]
        for key, ga, gb, bound in pairs:
            if ga is not None and gb is not None and bound is not None and gb.numel() == bound.numel():
                problems += ev.compare(ga, gb.to(torch.float64).reshape(bound.shape), 2 * bound, f"{key} vs {what}",
                                       GRADIENT, equal_nan=True)
        return problems


class LinearJudge(TokenJudge):
    """The fused-linear level's: the weight shard's gradient is its slice of the full head's, and every
    rank's hidden-state gradient is the full one (all-reduced over the TP group); a frozen input gets None."""

    def grad_shapes(self, c: Any) -> dict[str, tuple[tuple[int, ...], str]]:
        return {"grad": ((c.v_local, c.H), "the weight's"), "grad_hidden": ((c.T, c.H), "the hidden states'")}

    def group_gradients(self, ev: Evidence, group: list, second: bool, exp: Any, call: str) -> list[str]:
        grad = ev.full_grad(group, second)
        problems = []
        if exp.grad is not None and exp.grad_tol is not None:
            if grad is None:
                problems.append(Problem(f"no gradient reached the weight shard{call}", GRADIENT))
            else:
                problems += ev.compare(grad, exp.grad, exp.grad_tol, f"weight grad (all shards){call}", GRADIENT)
        if exp.grad_hidden is None or exp.grad_hidden_tol is None:
            return problems
        # Column-parallel: every rank must hold the full gradient of the replicated hidden states.
        for r in group:
            got = r.obs.grad_hidden_2 if second else r.obs.grad_hidden
            if got is None:
                problems.append(Problem(f"rank {r.rank}: no gradient reached the hidden states{call}", GRADIENT))
            else:
                problems += ev.compare(got, exp.grad_hidden, exp.grad_hidden_tol, f"rank {r.rank} hidden grad{call}",
                                       GRADIENT)
        return problems


KERNEL_JUDGE = TokenJudge()
LINEAR_JUDGE = LinearJudge()
