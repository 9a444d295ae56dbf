"""Empirical study of the fused-linear error bound (`tolerance.linear_bounds`, docs/tolerances.md,
"The fused-linear level"): correct float32 designs and deliberate defects, run in one process on
simulated TP shards and compared with the float64 oracle; per (variant, quantity) the worst
|error| / bound over the cases. Correct variants must stay well below 1, defects must exceed it.

    python scripts/studies/linear_tolerance_study.py [--quick]      (about 1 minute; --quick: a few seconds)
"""
from __future__ import annotations

import itertools
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from harness.cases.case import LinearCase
from harness.checks import oracle
from harness.checks.tolerance import compare
from harness.targets.fused import LINEAR_ROUTINE

F32 = torch.float32
QUANTITIES = ("log_prob", "entropy", "grad_hidden", "grad_weight")
Outputs = dict[str, torch.Tensor]


def _leaves(case: LinearCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    inp = case.inputs()
    return (inp.hidden.clone().requires_grad_(), inp.weight.clone().requires_grad_(), inp.tokens,
            inp.w_log_prob, inp.w_entropy)


def _backward(case: LinearCase, lp: torch.Tensor, ent: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> Outputs:
    _, _, _, w1, w2 = _leaves(case)
    ((lp * w1).sum() + (ent * w2).sum()).backward()
    return {"log_prob": lp, "entropy": ent, "grad_hidden": h.grad, "grad_weight": w.grad}


def builtin(case: LinearCase) -> Outputs:
    """The built-in routine, chunked as the case says (one rank: the whole head)."""
    h, w, t, _, _ = _leaves(case)
    lp, ent = LINEAR_ROUTINE.calculate_linear_log_probs_and_entropy(h, w, t, None, with_entropy=True,
                                                                   chunk_size=case.chunk_size)
    return _backward(case, lp, ent, h, w)


def _autograd(case: LinearCase, logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Outputs:
    h, w, t, _, _ = _leaves(case)
    x = logits(h, w)
    logp = x.log_softmax(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return _backward(case, logp[torch.arange(case.T), t], ent, h, w)


def autograd_f32(case: LinearCase) -> Outputs:
    """Unfused float32 autograd: F.linear on upcast inputs, log_softmax, entropy."""
    return _autograd(case, lambda h, w: h.float() @ w.float().T)


def sharded(case: LinearCase) -> Outputs:
    """Vocab-parallel by hand over case.tp shards, as Megatron runs it: per-shard float32 logits and
    statistics combined over the shards, G per shard, the partial G_r W_r rounded to the inputs'
    dtype and summed in it (Megatron all-reduces the column-parallel input gradient in bf16)."""
    h, w, t, w1, w2 = _leaves(case)
    hf, shards = h.detach().float(), w.detach().float().chunk(case.tp)
    xs = [hf @ s.T for s in shards]
    m = torch.stack([x.max(-1).values for x in xs]).max(0).values
    es = [torch.exp(x - m.unsqueeze(-1)) for x in xs]
    S = sum(e.sum(-1) for e in es)
    lse = m + S.log()
    x = torch.cat(xs, -1)
    p = torch.cat(es, -1) / S.unsqueeze(-1)
    lp = x[torch.arange(case.T), t] - lse
    ent = lse - (p * x).sum(-1)
    g = -w1.unsqueeze(-1) * p
    g[torch.arange(case.T), t] += w1
    g += w2.unsqueeze(-1) * -p * (x - lse.unsqueeze(-1) + ent.unsqueeze(-1))
    gs = g.chunk(case.tp, -1)
    dh = torch.zeros_like(h)
    for gr, s in zip(gs, shards, strict=True):
        dh = dh + (gr @ s).to(h.dtype)
    dw = torch.cat([(gr.T @ hf).to(w.dtype) for gr in gs])
    return {"log_prob": lp, "entropy": ent, "grad_hidden": dh, "grad_weight": dw}


def bf16_matmul(case: LinearCase) -> Outputs:
    """Defect: the logits from a bf16 matmul (the products' sum rounded to bf16)."""
    return _autograd(case, lambda h, w: (h.bfloat16() @ w.bfloat16().T).float())


def bf16_logit_grad(case: LinearCase) -> Outputs:
    """Defect for float32 inputs: the logit gradient G rounded to bf16 before dh = G W and dW = G^T h."""
    class RoundGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g.bfloat16().float()
    return _autograd(case, lambda h, w: RoundGrad.apply(h.float() @ w.float().T))


CORRECT = {"builtin": builtin, "autograd-f32": autograd_f32, "sharded": sharded}
DEFECTS = {"bf16-matmul": bf16_matmul, "bf16-logit-grad (fp32 inputs)": bf16_logit_grad}


def study_cases(quick: bool) -> list[LinearCase]:
    Hs, Vs, seeds = ((8, 64), (32,), (1,)) if quick else ((1, 8, 64, 256), (8, 64, 256), (1, 2, 3))
    out = []
    for H, V, tp, dtype, regime, seed in itertools.product(Hs, Vs, (1, 2, 4), ("fp32", "bf16", "fp16"),
                                                           ("normal", "peaked", "wide"), seeds):
        if V % tp == 0:
            out.append(LinearCase(tp=tp, T=24, H=H, v_local=V // tp, dtype=dtype, regime=regime, chunk_size=7,
                                  seed=seed))
    return out


def worst(variant: Callable[[LinearCase], Outputs], cases: list[LinearCase],
          dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")) -> dict[str, float]:
    """The worst |error| / bound of each quantity over the cases of the given input dtypes."""
    ratios: dict[str, float] = defaultdict(float)
    for case in cases:
        if case.dtype not in dtypes:
            continue
        exp = oracle.expected(case)
        got = variant(case)
        want = {"log_prob": (exp.log_prob, exp.log_prob_tol), "entropy": (exp.entropy, exp.entropy_tol),
                "grad_hidden": (exp.grad_hidden, exp.grad_hidden_tol), "grad_weight": (exp.grad, exp.grad_tol)}
        for q in QUANTITIES:
            _, r = compare(got[q], *want[q], q)
            ratios[q] = max(ratios[q], r or 0.0)
    return dict(ratios)


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    cases = study_cases("--quick" in argv)
    print(f"{len(cases)} cases (T=24, chunk 7, TP 1/2/4, fp32/bf16/fp16, normal/peaked/wide); "
          "worst |error| / bound:")
    print(f"{'variant':34}" + "".join(f"{q:>13}" for q in QUANTITIES))
    rows = [(f"{n} ({dt})", v, (dt,)) for n, v in CORRECT.items() for dt in ("fp32", "bf16", "fp16")]
    rows += [(n, v, ("fp32",) if "fp32 inputs" in n else ("fp32", "bf16", "fp16")) for n, v in DEFECTS.items()]
    for name, variant, dtypes in rows:
        r = worst(variant, cases, dtypes)
        print(f"{name:34}" + "".join(f"{r[q]:13.3g}" for q in QUANTITIES))


if __name__ == "__main__":
    main(sys.argv[1:])
