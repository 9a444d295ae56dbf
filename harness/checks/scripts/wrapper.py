"""The wrapper level's stand-alone scripts (`WRAPPER_SCRIPT`): one rank's shard of a packed batch's
logits handed to slime's `get_log_probs_and_entropy` with an `args` namespace, each sample's tokens
(and a recorded nucleus), judged per sample against the float64 log-softmax of its response rows.

Named for its level, as `checks/wrapper.py` judges it and `reference/wrapper.py` is its oracle.
"""
from __future__ import annotations

from typing import Any

from harness.checks.scripts import ANY, LevelScript, Parts, code, dtype, metered, regime
from harness.checks.scripts.kernel import NONE

VALUES = ("wrapper-extraction", "wrapper-entropy", "temperature", "top-p-replay")


def write(case: Any, check: str, term: str, memory: bool) -> Parts:
    coef = 0.0 if case.entropy_coef is None else case.entropy_coef
    ent_in = case.with_entropy and coef != 0
    backward = check in ("wrapper-gradients", "crash", "memory-logits-dtype")
    # The loss weighs every differentiable output, as the harness's does, with or without response
    # rows: an entropy that keeps its gradient at entropy_coef 0 (slime #2153) puts its term in the
    # gradient, which the expectation leaves out. A crash or memory case may have nothing to differentiate.
    lossed = "sum(((w * o).sum() for o, w in zip(res['log_probs'] + (res.get('entropy') or []), w_lp + w_ent) " \
        "if o.requires_grad), torch.zeros(()))"
    body = "    _, res = CALL"
    after = "" if not backward else f"\n    ({lossed}).backward()" if check == "wrapper-gradients" else \
        f"\n    loss = {lossed}\n    if loss.requires_grad:\n        loss.backward()"
    out = ('{"log-prob": res["log_probs"], "entropy": res.get("entropy"), "grad": shard.grad, '
           '"flags": [e.requires_grad for e in res.get("entropy") or []]}')
    body, after, out = metered(body, after, out, memory)
    nucleus = "\n    ids = [[torch.randperm(V, generator=g)[:int(torch.randint(1, V + 1, (1,), generator=g))].tolist() for _ in range(R)]\n" \
              "           for R in RESPONSE_LENGTHS]  # each response row's recorded nucleus" if case.top_p != "none" else ""
    inputs = f'''
def inputs():
    """The packed logits [T, V], each sample's tokens{", each response row's nucleus" if nucleus else ""} and the loss's weights, from SEED."""
    g = torch.Generator().manual_seed(SEED)
    logits = torch.randn(T, V, generator=g, dtype=torch.float64)
    {regime(case)}
    tokens = [torch.randint(0, V, (L,), generator=g) for L in TOTAL_LENGTHS]{nucleus}
    w_lp, w_ent = [torch.randn(R, generator=g) for R in RESPONSE_LENGTHS], [torch.randn(R, generator=g) for R in RESPONSE_LENGTHS]
    return logits.to({dtype(case)}), tokens, {"ids" if nucleus else "None"}, w_lp, w_ent


{reference(case, check, term, ent_in) if check in VALUES + ("wrapper-gradients",) else ""}'''
    run = f'''
def run(fn, rank, group):
    """Rank `rank`'s shard of the packed logits, [1, T, V_LOCAL] as the model returns them; the call{"; the backward" if backward else ""}."""
    logits, tokens, ids, w_lp, w_ent = inputs()
    shard = logits[:, rank * V_LOCAL:(rank + 1) * V_LOCAL].clone().requires_grad_()
{body}{after}
    return {out}'''
    top_p = case.top_p != "none"
    args = {"logits": ("shard.unsqueeze(0)", ANY), "args": ("argparse.Namespace(**ARGS)", ANY),
            "unconcat_tokens": ("tokens", ANY), "total_lengths": ("list(TOTAL_LENGTHS)", ANY),
            "response_lengths": ("list(RESPONSE_LENGTHS)", ANY), "with_entropy": (repr(case.with_entropy), case.with_entropy),
            "top_p_token_ids": ("[sum(n, []) for n in ids]", ANY) if top_p else ("None", None),
            "top_p_token_offsets": ("[[0, *torch.tensor([len(r) for r in n]).cumsum(0).tolist()] for n in ids]", ANY)
            if top_p else ("None", None)}
    args_ns = vars(case.args())  # every field the harness hands the wrapper: a trainer reads them as attributes
    judge = {"wrapper-gradients": gradients(case, ent_in), "entropy-coef-rule": RULE, "crash": NONE}.get(check, VALUES_JUDGE)
    terms = {"wrapper-extraction": ["log-prob"], "wrapper-entropy": ["entropy"], "top-p-replay": ["log-prob"]}.get(
        check, [term] if term else ["log-prob", "entropy"] if case.with_entropy else ["log-prob"])
    judge = judge.replace("TERMS", repr(terms))
    about = {"wrapper-gradients": "a wrong gradient of the response rows' loss", "entropy-coef-rule":
             f"the entropy's autograd state breaks slime #2153's rule (entropy_coef={case.entropy_coef!r})",
             "crash": "the call or its backward raises", "memory-logits-dtype": "a float32 copy of all the logits"}.get(
        check, f"wrong per-sample {' and '.join(terms)}")
    about += f" at TP {case.tp}" + (f", {case.dtype} logits" if case.dtype != "fp32" else "") + \
        (f", temperature {case.temperature}" if case.temperature not in (None, 1.0) else "") + (", top-p replay" if top_p else "")
    return Parts(inputs, run, judge, args, about, {"TOTAL_LENGTHS": tuple(case.total_lengths),
                                                   "RESPONSE_LENGTHS": tuple(case.response_lengths), "ARGS": args_ns,
                                                   "WITH_ENTROPY": case.with_entropy})


def reference(case: Any, check: str, term: str, ent_in: bool) -> str:
    """`reference(x, tokens, ids)`: per sample, the float64 log-probs (and entropies, where the script
    reads them) of its response rows, the logits at the temperature, the nucleus replayed for the log-probs."""
    nucleus = case.top_p != "none"
    entropy = case.with_entropy and term != "log-prob" and (check in ("wrapper-entropy", "temperature") or
                                                            check == "wrapper-gradients" and ent_in)
    temp = f" / {case.temperature!r}" if case.temperature not in (None, 1.0) else ""
    lines = ["def reference(x, tokens, ids):  # per sample: its response rows' float64 values (row j predicts token j + 1)",
             "    lps, ents, start = [], [], 0",
             f"    for toks, L, R, nucleus in zip(tokens, TOTAL_LENGTHS, RESPONSE_LENGTHS, {'ids' if nucleus else '[None] * len(tokens)'}):",
             f"        rows, targets, start = x[start + L - R - 1:start + L - 1]{temp}, toks[L - R:], start + L"]
    if nucleus:
        lines += ["        keep = torch.zeros(R, V, dtype=torch.bool).index_put((torch.arange(R), targets), torch.tensor(True))",
                  "        keep |= torch.stack([torch.zeros(V, dtype=torch.bool).index_fill(0, torch.tensor(n, dtype=torch.long), True) for n in nucleus])",
                  "        lps.append(torch.log_softmax(rows.masked_fill(~keep, -math.inf), -1)[torch.arange(R), targets])"]
    else:
        lines.append("        lps.append(torch.log_softmax(rows, -1)[torch.arange(R), targets])")
    if entropy:
        lines.append("        ents.append(-(torch.softmax(rows, -1) * torch.log_softmax(rows, -1).nan_to_num(0, 0, 0)).sum(-1))")
    return "\n".join(lines + ["    return lps, ents"])


VALUES_JUDGE = code('''
    def judge(results):
        """Each rank's per-sample response values against the float64 ones of the same rows."""
        logits, tokens, ids, _, _ = inputs()
        x = logits.double()
        want = dict(zip(("log-prob", "entropy"), reference(x, tokens, ids)))
        for (rank, r), term in itertools.product(enumerate(results), TERMS):
            for i, (g, w) in enumerate(zip(r[term], want[term])):
                if (found := off(g, w, 64 * 2**-24 * (x.abs().max() + math.log(V))))[0].any():
                    yield f"rank {rank}'s {term} of sample {i} is wrong at response row(s) {found[0].nonzero().flatten().tolist()}: {found[1]}"''')

RULE = code('''
    def judge(results):
        """slime #2153: the entropy is differentiable exactly when entropy_coef != 0 (absent is 0)."""
        want = WITH_ENTROPY and ARGS.get("entropy_coef", 0.0) != 0
        return [f"rank {rank}'s entropy of sample {i} has requires_grad={flag} with entropy_coef="
                f"{ARGS.get('entropy_coef', 'absent')}; {want} expected" for rank, r in enumerate(results)
                for i, flag in enumerate(r["flags"]) if flag != want][:1]''')


def gradients(case: Any, ent_in: bool) -> str:
    """The gradient w.r.t. each rank's shard of the loss over the response rows (the entropy's term in
    it exactly when entropy_coef != 0), against float64 autograd; at TP > 1, whether the rank owns
    the wrong rows' targets (where a sharded log-softmax goes wrong)."""
    # reference() returns the entropies only where they are in the loss: w_lp + w_ent pairs with lps (+ ents).
    loss = "sum((w * v).sum() for w, v in zip(w_lp + w_ent, sum(reference(x, tokens, ids), [])))"
    owned = ' + {frozenset({True}): ", whose target it owns", frozenset({False}): ", whose target it does not own"}' \
        '.get(frozenset(int(nxt[j]) // V_LOCAL == rank for j in rows), "")' if case.tp > 1 else ""
    return code(f'''
        def judge(results):
            """The gradient of the response rows' loss w.r.t. each rank's shard, against float64 autograd."""
            logits, tokens, ids, w_lp, w_ent = inputs()
            x, nxt = logits.double().requires_grad_(), torch.roll(torch.cat(tokens), -1)  # packed row j's target: token j + 1
            want = torch.autograd.grad({loss}, x)[0]
            tol = 64 * 2**-24 * (x.abs().max() + math.log(V)) * max(max(w.abs().max() for w in w_lp), 1.0)
            for rank, r in enumerate(results):
                if (found := off(r["grad"], want[:, rank * V_LOCAL:(rank + 1) * V_LOCAL], tol))[0].any():
                    rows = found[0].any(-1).nonzero().flatten().tolist()
                    yield f"rank {{rank}}'s shard of the gradient is wrong in packed row(s) {{rows}}"{owned} + f": {{found[1]}}"''')


def refuse(case: Any) -> str | None:
    if (case.layout, case.token_layout) != ("contiguous", "contiguous"):
        return "scripts hand over contiguous logits and tokens (layout, token_layout at their defaults)"
    if case.cp > 1:
        return "scripts run one TP group without context parallelism (cp=1)"
    if case.top_p == "partial":
        return "scripts replay a full recorded nucleus (top_p=full)"
    return None


WRAPPER_SCRIPT = LevelScript(
    checks=VALUES + ("wrapper-gradients", "entropy-coef-rule", "crash", "memory-logits-dtype"),
    write=write,
    refuse=refuse,
    alone=("wrapper-gradients",),
    raising=("entropy-coef-rule",),
    parallel_state=True,
)
