"""How the error of a weight gradient accumulated over row chunks in a low-precision dtype grows with
the number of chunks, against the derived bound (docs/tolerances.md, "Deep accumulation over chunks").

A fused-linear routine forms dW = sum over chunks of G[rows]^T h[rows]. The contract sums the chunks
in float32 and rounds once; a routine that keeps the running sum in the inputs' dtype (bf16/fp16)
rounds it once per chunk. The bound (`tolerance.linear_bounds`) allows one ulp of the dtype on
|G|^T |h| and on |dW|, which a few chunks' roundings stay inside; each extra chunk adds a rounding of
the running sum, and the sum of those grows faster than |G|^T |h| wherever the terms drift (the same
sign over many rows). Trainers' data drift: a loss weight of one sign over a response (SFT's mean
NLL, GRPO's per-response advantage) and hidden-state channels with a non-zero mean.

    python scripts/studies/deep_accumulation.py [--seeds 3]

Prints, per dtype, data ("zero-mean": the harness's shallow draws; "drifting": the deep regime's)
and number of chunks, the worst |error| / bound over dW's entries for the float32 accumulation
(the built-in) and for the low-precision one.
"""
from __future__ import annotations

import argparse

import torch

from harness import reference
from harness.cases.case import DTYPES, LinearCase
from harness.checks.tolerance import linear_bounds


def _dw(g: torch.Tensor, h: torch.Tensor, chunk: int, acc: torch.dtype) -> torch.Tensor:
    """sum over row chunks of g[rows]^T h[rows] (float32 products), the running sum kept in `acc`."""
    s = torch.zeros(g.shape[1], h.shape[1], dtype=acc)
    for a in range(0, g.shape[0], chunk):
        s = (s.float() + g[a:a + chunk].float().T @ h[a:a + chunk].float()).to(acc)
    return s.to(torch.float64)


def ratio(case: LinearCase, acc: str | None) -> float:
    """Worst |error| / bound of dW for the case's inputs, accumulated in float32 (acc None, then
    rounded once to the inputs' dtype) or in the `acc` dtype per chunk."""
    inp = case.inputs()
    h, w = inp.hidden, inp.weight
    x = reference.linear_logits(h.double(), w.double())
    w2 = inp.w_entropy if case.expects_entropy_grad else None
    g = reference.logits_grad(x, inp.tokens, None, inp.w_log_prob, w2)
    exact = g.T @ h.double()
    got = _dw(g, h, case.chunk_size, torch.float32).to(DTYPES[case.dtype]).double() if acc is None \
        else _dw(g, h, case.chunk_size, DTYPES[acc])
    bound = linear_bounds(h, w, inp.tokens, inp.w_log_prob, w2, tp=case.tp, dtype=case.dtype)["grad_weight"]
    return float(((got - exact).abs() / bound).max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=2)
    args = ap.parse_args()
    print(f"worst |error| / bound of dW (H 8, V 16, chunk {args.chunk} rows; max over {args.seeds} seeds)")
    print(f"{'dtype':5} {'data':10} {'chunks':>6} {'T':>5} {'float32 acc':>12} {'dtype acc':>10}")
    for dtype in ("bf16", "fp16"):
        for regime in ("normal", "drift"):
            for chunks in (4, 12, 32, 64, 128, 256, 512):
                T = chunks * args.chunk
                cases = [LinearCase(tp=1, T=T, H=8, v_local=16, dtype=dtype, regime=regime,
                                    chunk_size=args.chunk, with_entropy=False, seed=s) for s in range(args.seeds)]
                f32 = max(ratio(c, None) for c in cases)
                low = max(ratio(c, dtype) for c in cases)
                name = "zero-mean" if regime == "normal" else "drifting"
                print(f"{dtype:5} {name:10} {chunks:>6} {T:>5} {f32:>12.3f} {low:>10.2f}")


if __name__ == "__main__":
    main()
