"""The kernel level's stand-alone scripts (`KERNEL_SCRIPT`): one rank's shard of the logits handed to
`calculate_log_probs_and_entropy`, judged against the float64 log-softmax of the whole row.

Named for its level, as `checks/kernel.py` judges it and `reference/kernel.py` is its oracle. The
token levels' shared parts (the targets' shard edges, the float64 log-prob and entropy as script
code, the row and shard a wrong entry sits in) are here; `scripts/linear.py` reuses them.
"""
from __future__ import annotations

from typing import Any

from harness.checks.scripts import ANY, LevelScript, Parts, code, dtype, metered, regime

# The float64 answers as script expressions of `x` (the float64 logits [T, V], or the keep-masked ones
# `xm` for the log-prob) and `tokens`.
LOG_PROB = "torch.log_softmax(xm, -1)[torch.arange(T), tokens]"
ENTROPY = "-(torch.softmax(x, -1) * torch.log_softmax(x, -1).nan_to_num(0, 0, 0)).sum(-1)"


def edges(case: Any) -> str:
    """The first and last id of every shard, for every TP layout of the vocab (where offset and
    boundary bugs live), on the first targets, as the harness draws them."""
    vocab = case.tp * case.v_local
    ids = sorted({i for k in (1, 2, 4, 8) if vocab % k == 0 for r in range(k)
                  for i in (r * (vocab // k), (r + 1) * (vocab // k) - 1)})[:case.T]
    return f"tokens[:{len(ids)}] = torch.tensor({ids})  # the shards' first and last ids: where offset bugs live" \
        if ids else ""


def log_prob(case: Any) -> str:
    """The float64 log-prob of the (keep-masked, `xm`) logits."""
    return LOG_PROB if getattr(case, "mask", "none") != "none" else LOG_PROB.replace("xm", "x")


def masked(case: Any) -> str:
    """`xm`: the float64 logits keep-masked for the log-prob (the target always kept), or `x`."""
    if getattr(case, "mask", "none") == "none":
        return ""
    return "xm = x.masked_fill(~keep, -math.inf).index_put((torch.arange(T), tokens), x[torch.arange(T), tokens])"


def terms(case: Any, term: str) -> list[str]:
    """The outputs a values judge compares: the finding's term, or every output the case returns."""
    outs = ["log-prob", "entropy"] if case.with_entropy else ["log-prob"]
    return [term] if term in outs else outs


def in_loss(case: Any) -> tuple[bool, bool]:
    """Whether the log-prob and the entropy are in the upstream loss."""
    return case.loss_terms != "entropy", case.loss_terms != "log_prob" and case.expects_entropy_grad


def loss(case: Any, lp: str, ent: str) -> str:
    """The upstream loss: sum(w_lp * log_prob) + sum(w_ent * entropy) over the terms in it."""
    on = in_loss(case)
    return " + ".join(t for t, o in ((f"(w_lp * {lp}.reshape(-1)).sum()", on[0]),
                                     (f"(w_ent * {ent}.reshape(-1)).sum()", on[1])) if o)


def judge_values(case: Any, term: str, where_target: str) -> str:
    """Each rank's outputs (one per term) against the float64 answer, per row."""
    pairs = ", ".join(f'("{t}", "{t.replace("-", "_")}", {log_prob(case) if t == "log-prob" else ENTROPY})'
                      for t in terms(case, term))
    return code(f'''
        def judge(results):
            """Each rank's outputs against the float64 answer of the same rows."""
            logits, tokens, keep, w_lp, w_ent = inputs()
            x = {where_target}
            {masked(case)}
            tol = 64 * 2**-24 * (x[x.isfinite()].abs().max() + math.log(V))  # float32 rounding at the inputs' scale
            for term, key, want in [{pairs}]:
                for rank, r in enumerate(results):
                    if (found := off(r[key], want, tol))[0].any():
                        rows = found[0].nonzero().flatten().tolist()
                        owners = sorted({{int(tokens[i]) // V_LOCAL for i in rows}}) if term == "log-prob" and TP > 1 else []
                        on = f" (targets on the shard of rank(s) {{owners}})" if owners else ""
                        yield f"rank {{rank}}'s {{term}} is wrong in row(s) {{rows}}{{on}}: {{found[1]}}"''')


def judge_gradients(case: Any, term: str, x: str, weight_of: str) -> str:
    """The gradient each rank's shard receives against the float64 gradient of the same loss."""
    what = f"the {term} term's gradient" if term else "the gradient"
    # At TP > 1, whether the rank owns the wrong rows' targets: where a sharded log-softmax goes wrong.
    owned = ' + {frozenset({True}): ", whose target it owns", frozenset({False}): ", whose target it does not own"}' \
        '.get(frozenset(int(tokens[i]) // V_LOCAL == rank for i in rows), "")' if case.tp > 1 else ""
    return code(f'''
        def judge(results):
            """The gradient of the loss w.r.t. each rank's shard, against float64 autograd of the same loss."""
            logits, tokens, keep, w_lp, w_ent = inputs()
            x = {x}.requires_grad_()
            {masked(case)}
            want = torch.autograd.grad({loss(case, log_prob(case), ENTROPY).replace("w_lp", "w_lp.double()").replace("w_ent", "w_ent.double()")}, x)[0]
            tol = 64 * 2**-24 * (x[x.isfinite()].abs().max() + math.log(V)) * {weight_of} + want.abs().max() * torch.finfo({dtype(case)}).eps
            for rank, r in enumerate(results):
                shard = want[:, rank * V_LOCAL:(rank + 1) * V_LOCAL]
                if (found := off(r["grad"] if r["grad"] is not None else 0 * shard, shard, tol))[0].any():
                    rows = found[0].any(-1).nonzero().flatten().tolist()
                    yield f"rank {{rank}}'s shard of {what} is wrong in row(s) {{rows}}"{owned} + f": {{found[1]}}"''')


def write(case: Any, check: str, term: str, memory: bool) -> Parts:
    lp_on, ent_on = in_loss(case)
    backward = check != "values" and case.has_backward
    body = "    log_prob, entropy = CALL"
    after = f"\n    ({loss(case, 'log_prob', 'entropy')}).backward()" if backward else ""
    body, after, out = metered(body, after, '{"log_prob": log_prob, "entropy": entropy, "grad": shard.grad}', memory)
    neginf = "\n    logits[torch.arange(T), tokens] = torch.randn(T, generator=g, dtype=torch.float64)  # finite targets" \
        if case.regime == "neginf" else ""
    keep = {"none": "None",
            "random": "torch.rand(T, V, generator=g) < 0.5",
            "drop_target": "(torch.rand(T, V, generator=g) < 0.5).index_put((torch.arange(T), tokens), torch.tensor(False))",
            "only_target": "torch.zeros(T, V, dtype=torch.bool)"}[case.mask]
    inputs = f'''
def inputs():
    """The logits [T, V], the targets, the keep mask and the loss's weights, from SEED."""
    g = torch.Generator().manual_seed(SEED)
    logits = torch.randn(T, V, generator=g, dtype=torch.float64)
    {regime(case)}
    tokens = torch.randint(0, V, (T,), generator=g)
    {edges(case)}{neginf}
    {"keep = " + keep if case.mask != "none" else ""}
    w_lp, w_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)
    return logits.to({dtype(case)}), tokens, {"keep" if case.mask != "none" else "None"}, w_lp, w_ent'''
    run = f'''
def run(fn, rank, group):
    """Rank `rank`'s shard of the logits, a leaf as the model's output is; the call{"; the backward" if backward else ""}."""
    logits, tokens, keep, w_lp, w_ent = inputs()
    shard = logits[:, rank * V_LOCAL:(rank + 1) * V_LOCAL].clone().requires_grad_({case.requires_grad})
{body}{after}
    return {out}'''
    args = {"logits": ("shard", ANY), "tokens": ("tokens", ANY), "tp_group": ("group", ANY),
            "with_entropy": (repr(case.with_entropy), case.with_entropy), "chunk_size": (repr(case.chunk_size), case.chunk_size),
            "log_prob_keep_mask": ("keep[:, rank * V_LOCAL:(rank + 1) * V_LOCAL]", ANY) if case.mask != "none" else ("None", None),
            "with_entropy_grad": (repr(case.with_entropy_grad), case.with_entropy_grad)}
    return Parts(inputs, run, judge(case, check, term), args, about(case, check, term))


def judge_finite(case: Any, x: str) -> str:
    """NaN or inf in an output where the float64 answer is finite."""
    return code(f'''
        def judge(results):
            """NaN or inf in each rank's outputs where the float64 answer is finite."""
            logits, tokens, keep, w_lp, w_ent = inputs()
            x = {x}
            {masked(case)}
            wants = [("log-prob", "log_prob", {log_prob(case)}), ("entropy", "entropy", {ENTROPY})]
            for rank, r in enumerate(results):
                for term, key, want in wants[:len([o for o in (r["log_prob"], r["entropy"]) if o is not None])]:
                    bad = ~r[key].reshape(-1).isfinite() & want.isfinite()
                    if bad.any():
                        i = int(bad.nonzero()[0])
                        yield (f"rank {{rank}}'s {{term}} is {{r[key].reshape(-1)[i].item()}} in row(s) "
                               f"{{bad.nonzero().flatten().tolist()}}, where {{want[i]:.6g}} is expected (row {{i}})")''')


NONE = "def judge(results):\n    return []  # the ranks' errors are the finding"
EMPTY = code('''
    def judge(results):
        """A call on no rows returns empty outputs."""
        return [f"rank {rank}'s {key} has {v.numel()} entries for T == 0" for rank, r in enumerate(results)
                for key, v in r.items() if key != "grad" and torch.is_tensor(v) and v.numel()]''')


def about(case: Any, check: str, term: str) -> str:
    """What the script shows, for its title."""
    where = f"at TP {case.tp}" + (f", {case.dtype} logits" if case.dtype != "fp32" else "") + \
        (f", chunk_size={case.chunk_size}" if case.chunk_size > 0 else "") + \
        (f", {case.regime} logits" if case.regime != "normal" else "") + \
        (f", keep mask {case.mask}" if getattr(case, "mask", "none") != "none" else "")
    return {"values": f"wrong {' and '.join(terms(case, term))} values {where}",
            "gradients": f"a wrong gradient{f' of the {term} term' if term else ''} {where}",
            "finite": f"NaN or inf outputs where the answer is finite {where}",
            "crash": f"the call or its backward raises {where}",
            "empty-input": f"a call on no rows fails {where}",
            "memory-logits-dtype": f"a float32 copy of all the logits {where}"}[check]


def judge(case: Any, check: str, term: str, x: str = "logits.double()") -> str:
    if check == "values":
        return judge_values(case, term, x)
    if check == "gradients":
        return judge_gradients(case, term, x, "max(w_lp.abs().max(), w_ent.abs().max())")
    if check == "finite":
        return judge_finite(case, x)
    return EMPTY if check == "empty-input" else NONE


def refuse(case: Any) -> str | None:
    if (case.layout, case.token_layout) != ("contiguous", "contiguous"):
        return "scripts hand over contiguous logits and tokens (layout, token_layout at their defaults)"
    if case.batch_of:
        return "scripts draw a case's own rows (batch_of=0)"
    return None


KERNEL_SCRIPT = LevelScript(
    checks=("values", "gradients", "finite", "crash", "empty-input", "memory-logits-dtype"),
    write=write,
    refuse=refuse,
    alone=("gradients",),
)
