"""Empirical study of the float32 error bounds of `harness/checks/tolerance.py` (docs/tolerances.md).

Several correct float32 designs (and two bf16 defects) are run on simulated TP shards and compared
to the float64 oracle; for every (variant, regime, V) the worst |err| / bound is reported (must be
<= 1 for correct variants, >= 10 for the defects), next to the same ratio under the current scalar
policy K*u*(max|x| + ln V).

    python scripts/studies/tolerance_study.py [--quick] > docs/tolerance_study.txt    (about 16 minutes on an idle 2-core machine; --quick: 1)
"""
from __future__ import annotations

import math
import sys
from collections import defaultdict
from pathlib import Path  # noqa: E402

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from harness.checks import tolerance as tol  # noqa: E402

torch.set_num_threads(2)
F32, F64 = torch.float32, torch.float64
NEG = float("-inf")

# ----------------------------------------------------------------------------------- sums


def sum_torch(t):
    return t.sum(-1)


def sum_seq(t):
    s = torch.zeros(t.shape[0], dtype=t.dtype)
    for j in range(t.shape[1]):
        s = s + t[:, j]
    return s


def sum_pairwise(t):
    n = t.shape[1]
    p = 1 << max(0, (n - 1).bit_length())
    t = torch.cat([t, torch.zeros(t.shape[0], p - n, dtype=t.dtype)], 1)
    while t.shape[1] > 1:
        h = t.shape[1] // 2
        t = t[:, :h] + t[:, h:]
    return t[:, 0]


def sum_blocked(t, b=1024):  # Triton-like: tree inside a block, sequential across blocks
    s = torch.zeros(t.shape[0], dtype=t.dtype)
    for j in range(0, t.shape[1], b):
        s = s + sum_pairwise(t[:, j:j + b])
    return s


SUMS = {"torch": sum_torch, "seq": sum_seq, "pair": sum_pairwise, "blk": sum_blocked}


def shards(x, tp):
    vl = math.ceil(x.shape[1] / tp)
    return [x[:, r * vl:(r + 1) * vl] for r in range(tp) if r * vl < x.shape[1]]


def merge(parts):  # cross-rank all-reduce, sequential in the compute dtype
    acc = parts[0].clone()
    for p in parts[1:]:
        acc = acc + p
    return acc


def rowsum(t, tp, how):
    return merge([SUMS[how](s) for s in shards(t, tp)])


def mask_rows(x, tokens, keep):
    if keep is None:
        return x
    k = keep.clone()
    k[torch.arange(x.shape[0]), tokens] = True
    return x.masked_fill(~k, NEG)


def onehot(x, tokens):
    o = torch.zeros_like(x)
    o[torch.arange(x.shape[0]), tokens] = 1
    return o


def safe_ent_term(p, logp, H):
    return torch.where(p > 0, -p * (logp + H.unsqueeze(-1)), torch.zeros_like(p))


# ----------------------------------------------------------------------------------- variants
# each: (x [T,V] in compute dtype, tokens, keep, w1, w2, tp) -> (lp, H, grad) in compute dtype


def fused_shifted(how, dtype=F32):
    def run(x, tokens, keep, w1, w2, tp):
        x = x.to(dtype)

        def stats(z):
            m = z.max(-1).values
            m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
            e = torch.exp(z - m.unsqueeze(-1))
            S = rowsum(e, tp, how)
            return m, e, S
        m, e, S = stats(x)
        W = rowsum(torch.where(e > 0, e * (x - m.unsqueeze(-1)), torch.zeros_like(e)), tp, how)
        lse = m + torch.log(S)
        H = torch.log(S) - W / S
        xm = mask_rows(x, tokens, keep)
        mm, em, Sm = stats(xm)
        xt = x[torch.arange(x.shape[0]), tokens]
        lp = xt - (mm + torch.log(Sm))
        q = em / Sm.unsqueeze(-1)
        p = e / S.unsqueeze(-1)
        g = w1.to(dtype).unsqueeze(-1) * (onehot(x, tokens) - q)
        g = g + w2.to(dtype).unsqueeze(-1) * safe_ent_term(p, x - lse.unsqueeze(-1), H)
        return lp, H, g
    return run


def online_blocks(x, tokens, keep, w1, w2, tp, B=1024):
    """Online softmax over vocab blocks per rank (running max, S, W), ranks merged by rescaling;
    backward recomputes p = exp(x - lse)."""
    def rank_stats(z):
        T = z.shape[0]
        m = torch.full((T,), NEG)
        S = torch.zeros(T)
        W = torch.zeros(T)  # sum e (x - m), <= 0
        for j in range(0, z.shape[1], B):
            blk = z[:, j:j + B]
            bm = torch.maximum(m, blk.max(-1).values)
            bm0 = torch.where(torch.isneginf(bm), torch.zeros_like(bm), bm)
            r = torch.where(torch.isneginf(m), torch.zeros_like(m), torch.exp(m - bm0))
            dm = torch.where(torch.isneginf(m), torch.zeros_like(m), m - bm0)
            e = torch.exp(blk - bm0.unsqueeze(-1))
            d = blk - bm0.unsqueeze(-1)
            W = r * (W + dm * S) + torch.where(e > 0, e * d, torch.zeros_like(e)).sum(-1)
            S = r * S + e.sum(-1)
            m = bm
        return m, S, W

    def merged(z):
        parts = [rank_stats(s) for s in shards(z, tp)]
        m = torch.stack([p[0] for p in parts]).max(0).values
        m0 = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        S = torch.zeros_like(m0)
        W = torch.zeros_like(m0)
        for mr, Sr, Wr in parts:
            fin = ~torch.isneginf(mr)
            dm = torch.where(fin, mr - m0, torch.zeros_like(mr))
            r = torch.where(fin, torch.exp(dm), torch.zeros_like(mr))
            S = S + r * Sr
            W = W + r * (Wr + dm * Sr)
        return m0, S, W
    m, S, W = merged(x)
    lse = m + torch.log(S)
    H = torch.log(S) - W / S
    xm = mask_rows(x, tokens, keep)
    mm, Sm, _ = merged(xm)
    lsem = mm + torch.log(Sm)
    xt = x[torch.arange(x.shape[0]), tokens]
    lp = xt - lsem
    q = torch.exp(xm - lsem.unsqueeze(-1))
    p = torch.exp(x - lse.unsqueeze(-1))
    g = w1.unsqueeze(-1) * (onehot(x, tokens) - q) + w2.unsqueeze(-1) * safe_ent_term(p, x - lse.unsqueeze(-1), H)
    return lp, H, g


def unshifted(how):
    """lse = log sum exp(x) on unshifted logits, H = lse - sum(p x) with p = exp(x)/S;
    backward recomputes p = exp(x - lse).  Needs max x < 88 (else NA)."""
    def run(x, tokens, keep, w1, w2, tp):
        if x[torch.isfinite(x)].max() > 80:
            return None
        e = torch.exp(x)
        S = rowsum(e, tp, how)
        lse = torch.log(S)
        p = e / S.unsqueeze(-1)
        px = torch.where(p > 0, p * x, torch.zeros_like(p))
        H = lse - rowsum(px, tp, how)
        xm = mask_rows(x, tokens, keep)
        lsem = torch.log(rowsum(torch.exp(xm), tp, how))
        xt = x[torch.arange(x.shape[0]), tokens]
        lp = xt - lsem
        q = torch.exp(xm - lsem.unsqueeze(-1))
        pr = torch.exp(x - lse.unsqueeze(-1))
        g = w1.unsqueeze(-1) * (onehot(x, tokens) - q) + w2.unsqueeze(-1) * safe_ent_term(pr, x - lse.unsqueeze(-1), H)
        return lp, H, g
    return run


def gathered_lse_px(x, tokens, keep, w1, w2, tp):
    """all-gather; H = torch.logsumexp(x) - sum(torch.softmax(x) * x); autograd backward."""
    x = x.detach().clone().requires_grad_(True)
    p = torch.softmax(x, -1)
    xs = torch.where(torch.isfinite(x), x, torch.zeros_like(x))   # p * (-inf) would give NaN grads
    H = torch.logsumexp(x, -1) - (p * xs).sum(-1)
    xm = mask_rows(x, tokens, keep)
    lp = xm[torch.arange(x.shape[0]), tokens] - torch.logsumexp(xm, -1)
    (lp * w1).sum().add((H * w2).sum()).backward()
    return lp.detach(), H.detach(), x.grad


def gathered_log_softmax(x, tokens, keep, w1, w2, tp):
    """all-gather + torch.log_softmax; H = -sum(exp(ls) ls); autograd backward."""
    x = x.detach().clone().requires_grad_(True)
    ls = torch.log_softmax(x, -1)
    p = ls.exp()
    H = -(p * torch.where(p > 0, ls, torch.zeros_like(ls))).sum(-1)
    lsm = torch.log_softmax(mask_rows(x, tokens, keep), -1)
    lp = lsm[torch.arange(x.shape[0]), tokens]
    (lp * w1).sum().add((H * w2).sum()).backward()
    return lp.detach(), H.detach(), x.grad


def bf16_grad(x, tokens, keep, w1, w2, tp):
    lp, H, g = fused_shifted("torch")(x, tokens, keep, w1, w2, tp)
    return lp, H, g.to(torch.bfloat16).to(F32)


VARIANTS = {
    "fused[torch]": fused_shifted("torch"),
    "fused[seq]": fused_shifted("seq"),
    "fused[pair]": fused_shifted("pair"),
    "fused[blk1024]": fused_shifted("blk"),
    "online[1024]": online_blocks,
    "unshift[torch]": unshifted("torch"),
    "unshift[seq]": unshifted("seq"),
    "gather lse-px": gathered_lse_px,
    "gather logsoftmax": gathered_log_softmax,
}
DEFECTS = {"bf16-math": fused_shifted("torch", torch.bfloat16), "bf16-grad": bf16_grad}

# ----------------------------------------------------------------------------------- regimes


def make(regime, T, V, gen):
    tokens = torch.randint(0, V, (T,), generator=gen)
    keep = None
    if regime == "normal":
        x = torch.randn(T, V, generator=gen)
    elif regime == "peaked":
        x = torch.randn(T, V, generator=gen)
        pos = torch.randint(0, V, (T,), generator=gen)
        x[torch.arange(T), pos] += 12 + 6 * torch.rand(T, generator=gen)
        half = torch.arange(T) % 2 == 0
        tokens = torch.where(half, pos, tokens)
    elif regime == "huge":
        x = (torch.randn(T, V, generator=gen) * 1e4).clamp(-3e4, 3e4)
    elif regime == "ties":
        x = torch.randint(0, 3, (T, V), generator=gen).to(F32)
    elif regime == "neginf":
        x = torch.randn(T, V, generator=gen)
        drop = torch.rand(T, V, generator=gen) < 0.3
        drop[torch.arange(T), tokens] = False
        x = x.masked_fill(drop, NEG)
        keep = torch.rand(T, V, generator=gen) < 0.5
    elif regime == "offset":  # large common offset: lse ~ 1000, stresses u*|x| terms
        x = 1000 + torch.randn(T, V, generator=gen)
    else:
        raise ValueError(regime)
    return x, tokens, keep


def rows_for(V, quick):
    base = 64 if V <= 1000 else (16 if V <= 8192 else 3)
    return max(2, base // (4 if quick else 1))


def oracle(x64, tokens, keep):
    from harness import reference
    return (reference.log_probs(x64, tokens, keep), reference.entropy(x64))


def oracle_grad(x64, tokens, keep, w1, w2):
    from harness import reference
    return reference.logits_grad(x64, tokens, keep, w1.to(F64), w2.to(F64))


def current_policy(x, w1=None, w2=None, K: float = 8.0) -> tuple[float, float]:
    """The earlier scalar policy, for comparison: (value atol, fp32 gradient atol)."""
    fin = x[torch.isfinite(x)]
    C = (fin.abs().max().item() if fin.numel() else 0.0) + math.log(x.shape[-1])
    wm = lambda w: 0.0 if w is None else w.abs().max().item()  # noqa: E731
    return K * tol.U32 * C, K * tol.U32 * C * (wm(w1) + wm(w2) * (2 + math.log(x.shape[-1])))


def worst_ratio(a, e, b) -> float:
    both = torch.isfinite(a) & torch.isfinite(e)
    b = b.reshape(b.shape + (1,) * (e.dim() - b.dim())).expand_as(e)
    r = (a - e).abs() / b.clamp_min(1e-300)
    return r[both].max().item() if both.any() else 0.0


def bounds(x64, tokens, keep, w1, w2, tp, dtype, exp):
    lp_b, H_b = tol.value_bounds(x64, tokens, keep, tp=tp)
    g_b = tol.grad_bound(x64, tokens, keep, w1, w2, tp=tp, dtype=dtype, grad=exp[2])
    cur_v, cur_g = current_policy(x64, w1, w2)
    cur_g += tol.OUT_U[dtype] * exp[2].abs().max().item()
    return lp_b, H_b, g_b, cur_v, cur_g


def ratios(out, exp, bnd):
    lp_e, H_e, g_e = exp
    lp_b, H_b, g_b, cur_v, cur_g = bnd
    lp, H, g = (t.to(F64) for t in out)
    res = {}
    for name, a, e, b, cur in (("lp", lp, lp_e, lp_b, cur_v), ("H", H, H_e, H_b, cur_v),
                               ("g", g, g_e, g_b, cur_g)):
        worst = worst_ratio(a, e, b)
        fin = torch.isfinite(e)
        bad = bool((fin & ~torch.isfinite(a)).any()) or bool(((~fin) & (a != e)).any())
        err = torch.where(fin & torch.isfinite(a), (a - e).abs(), torch.zeros_like(e))
        rowmax = (err / b.clamp_min(1e-300)) if b.shape == e.shape else err / b.reshape(-1)
        rowmax = rowmax.reshape(e.shape[0], -1).amax(-1)
        res[name] = (float("inf") if bad else worst, err.max().item() / cur, rowmax.median().item())
    return res


def main():
    quick = "--quick" in sys.argv
    Vs = [8, 26, 100, 1000, 8192, 131072]
    regimes = ["normal", "peaked", "huge", "ties", "neginf", "offset"]
    tps = [1, 2, 4, 8]
    gen = torch.Generator().manual_seed(1234)
    # table[(variant, regime)][V] = {q: (worst new, worst current, median new)}
    table = defaultdict(lambda: defaultdict(dict))
    for V in Vs:
        for regime in regimes:
            for tp in tps:
                if tp > V or (V > 8192 and tp not in (1, 4)):
                    continue
                T = rows_for(V, quick)
                x, tokens, keep = make(regime, T, V, gen)
                w1 = torch.randn(T, generator=gen)
                w2 = torch.randn(T, generator=gen)
                x64 = x.to(F64)
                exp = (*oracle(x64, tokens, keep), oracle_grad(x64, tokens, keep, w1, w2))
                xb = x.to(torch.bfloat16)
                xb64 = xb.to(F64)
                expb = (*oracle(xb64, tokens, keep), oracle_grad(xb64, tokens, keep, w1, w2))
                bnd = bounds(x64, tokens, keep, w1, w2, tp, "fp32", exp)
                bndb = bounds(xb64, tokens, keep, w1, w2, tp, "bf16", expb)
                for vname, fn in {**VARIANTS, **DEFECTS}.items():
                    if "seq" in vname and V > 8192 and (quick or tp != 4):
                        continue
                    if vname == "bf16-math":
                        out = fn(xb, tokens, keep, w1, w2, tp)
                        r = ratios(out, expb, bndb)
                    else:
                        out = fn(x, tokens, keep, w1, w2, tp)
                        if out is None:
                            continue
                        r = ratios(out, exp, bnd)
                    cell = table[(vname, regime)][V]
                    for q, (w, c, med) in r.items():
                        o = cell.get(q, (0.0, 0.0, []))
                        cell[q] = (max(o[0], w), max(o[1], c), o[2] + [med])
            print(f"# done V={V} {regime}", file=sys.stderr, flush=True)
    report(table, Vs, regimes)


def outside(vname, V):
    """Cells where the variant breaks the CHAIN assumption (longest sequential chain > CHAIN):
    python-loop sums over > CHAIN terms, and torch's CPU softmax / log_softmax / logsumexp, whose
    8-lane AVX2 accumulators chain V/8 terms."""
    if tol.CHAIN is None:
        return False
    if "seq" in vname:
        return V > tol.CHAIN
    if vname.startswith("gather"):
        return V / 8 > tol.CHAIN
    return False


def fmt(v):
    if v == float("inf"):
        return "  inf"
    if v == 0:
        return "    0"
    if v >= 100:
        return f"{v:5.0f}"
    return f"{v:5.2f}" if v >= 0.01 else f"{v:5.0e}".replace("e-0", "e-")


def report(table, Vs, regimes):
    print(f"u = 2^-24, C_FN = {tol.C_FN}, CHAIN = {tol.CHAIN}: D = min(2V, CHAIN + 2 ceil(V/CHAIN) + 2 tp), "
          f"g = D / (1 - D u)  (V=131072 runs TP 1 and 4 only; python-loop 'seq' sums at V=131072 only TP 4)")
    print("'*' = the variant breaks the CHAIN assumption there (a sequential chain longer than CHAIN).")
    print("Ratios = worst |err| / bound over TP in {1,2,4,8} and the rows (elementwise for the gradient).")
    print("Correct variants must be <= 1; bf16 defects must be >= 10. 'NA': design impossible (overflow).\n")
    for q, title in (("lp", "log_prob"), ("H", "entropy"), ("g", "gradient (elementwise)")):
        for which, label in ((0, "NEW per-row/element bound"), (1, "CURRENT K*u*C policy")):
            print(f"== {title}: {label}")
            print(f"{'variant':18s} {'regime':7s} " + " ".join(f"{V:>6d} " for V in Vs))
            for (vname, regime) in sorted(table, key=lambda k: (list({**VARIANTS, **DEFECTS}).index(k[0]), regimes.index(k[1]))):
                row = table[(vname, regime)]
                cells = [(fmt(row[V][q][which]) + ("*" if outside(vname, V) else " "))
                         if V in row and q in row[V] else "   NA " for V in Vs]
                print(f"{vname:18s} {regime:7s} " + " ".join(f"{c:>7s}" for c in cells))
            print()
    print("== typical tightness: median over rows of the per-row ratio (NEW bound), max over regimes")
    print(f"{'variant':18s} {'q':3s} " + " ".join(f"{V:>6d}" for V in Vs))
    for vname in {**VARIANTS, **DEFECTS}:
        for q in ("lp", "H", "g"):
            cells = []
            for V in Vs:
                meds = [m for (vn, rg), row in table.items() if vn == vname and V in row and q in row[V]
                        for m in row[V][q][2]]
                cells.append(fmt(float(torch.tensor(meds).median())) if meds else "   NA")
            print(f"{vname:18s} {q:3s} " + " ".join(f"{c:>6s}" for c in cells))
    print()
    print("== summary: worst ratio per variant over all regimes and V (NEW | CURRENT)")
    for vname in {**VARIANTS, **DEFECTS}:
        parts = []
        if vname in DEFECTS:  # detection per cell = max over the quantities it shows in
            qs = ("lp", "H") if vname == "bf16-math" else ("g",)
            for which in (0, 1):
                cells = [max(row[V][q][which] for q in qs) for (vn, rg), row in table.items()
                         if vn == vname for V in row]
                parts.append(f"min over cells of max({','.join(qs)}) {'NEW' if which == 0 else 'CURRENT'}: {fmt(min(cells))}")
            print(f"{vname:18s} defect   " + "   ".join(parts))
            continue
        for q in ("lp", "H", "g"):
            vals = [row[V][q] for (vn, rg), row in table.items() if vn == vname for V in row
                    if q in row[V] and not outside(vn, V)]
            parts.append(f"{q}: {fmt(max(v[0] for v in vals))} | {fmt(max(v[1] for v in vals))}")
        print(f"{vname:18s} max(in-class) " + "   ".join(parts))


if __name__ == "__main__":
    main()
