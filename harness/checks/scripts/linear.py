"""The fused-linear level's stand-alone scripts (`LINEAR_SCRIPT`): the hidden states and one rank's
rows of the LM head handed to `calculate_linear_log_probs_and_entropy`, judged against the float64
log-softmax of `hidden @ weight.T`, as `scripts/kernel.py` judges the kernel's.

Named for its level, as `reference/linear.py` is its oracle and `targets/mutants/linear.py` breaks it.
"""
from __future__ import annotations

from typing import Any

from harness.checks.scripts import ANY, LevelScript, Parts, code, dtype, metered
from harness.checks.scripts.kernel import EMPTY, ENTROPY, LOG_PROB, NONE, about, edges, judge_values, loss

LOGITS = "hidden.double() @ weight.double().T"


def write(case: Any, check: str, term: str, memory: bool) -> Parts:
    backward = check != "values" and case.has_backward
    body = "    log_prob, entropy = CALL"
    after = f"\n    ({loss(case, 'log_prob', 'entropy')}).backward()" if backward else ""
    out = '{"log_prob": log_prob, "entropy": entropy, "grad": shard.grad, "grad_hidden": h.grad}'
    body, after, out = metered(body, after, out, memory)
    scale = {"wide": 8.0}.get(case.regime, 2.0)
    inputs = f'''
def inputs():
    """The hidden states [T, H], the whole LM head [V, H], the targets and the loss's weights, from SEED."""
    g = torch.Generator().manual_seed(SEED)
    hidden, weight = torch.randn(T, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64) * {scale / max(case.H, 1) ** 0.5:.4g}
    tokens = torch.randint(0, V, (T,), generator=g)
    {edges(case)}
    w_lp, w_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)
    return hidden.to({dtype(case)}), weight.to({dtype(case)}), tokens, w_lp, w_ent'''
    grads = (case.requires_grad and case.frozen != "hidden", case.requires_grad and case.frozen != "weight")
    run = f'''
def run(fn, rank, group):
    """The hidden states and rank `rank`'s rows of the LM head, leaves as a trainer's are; the call{"; the backward" if backward else ""}."""
    hidden, weight, tokens, w_lp, w_ent = inputs()
    h, shard = hidden.clone().requires_grad_({grads[0]}), weight[rank * V_LOCAL:(rank + 1) * V_LOCAL].clone().requires_grad_({grads[1]})
{body}{after}
    return {out}'''
    args = {"hidden": ("h", ANY), "weight": ("shard", ANY), "tokens": ("tokens", ANY), "tp_group": ("group", ANY),
            "with_entropy": (repr(case.with_entropy), case.with_entropy), "chunk_size": (repr(case.chunk_size), case.chunk_size),
            "with_entropy_grad": (repr(case.with_entropy_grad), case.with_entropy_grad)}
    if check == "values":
        judge = judge_values(case, term, LOGITS).replace("logits, tokens, keep,", "hidden, weight, tokens,")
    elif check == "gradients":
        lossed = loss(case, "log_prob_of(x)", "entropy_of(x)").replace("w_lp", "w_lp.double()").replace("w_ent", "w_ent.double()")
        judge = GRADIENTS.replace("LOSS", lossed)
    elif check == "frozen-input-work":
        run, judge = FLOPS_RUN.replace("CALL", "CALL"), FLOPS
    else:
        judge = EMPTY if check == "empty-input" else NONE
    text = about(case, check if check != "frozen-input-work" else "crash", term)
    if check == "frozen-input-work":
        text = f"the frozen {case.frozen}'s gradient is computed anyway (matmul FLOPs) at TP {case.tp}"
    return Parts(inputs, run, judge, args, text, {"H": case.H, "FROZEN": case.frozen})


GRADIENTS = code(f'''
    def judge(results):
        """The gradients w.r.t. each rank's rows of the LM head and the hidden states, against float64 autograd."""
        hidden, weight, tokens, w_lp, w_ent = inputs()
        h, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
        log_prob_of, entropy_of, x = lambda xm: {LOG_PROB}, lambda x: {ENTROPY}, h @ wd.T
        want_h, want_w = torch.autograd.grad(LOSS, (h, wd))
        tol = 64 * 2**-24 * (x.abs().max() + math.log(V)) * max(w_lp.abs().max(), w_ent.abs().max()) * (h.abs().max() + wd.abs().max()) * H
        for rank, r in enumerate(results):
            for what, got, want, on in (("rows of the LM head", r["grad"], want_w[rank * V_LOCAL:(rank + 1) * V_LOCAL],
                                         FROZEN != "weight"), ("hidden states", r["grad_hidden"], want_h, FROZEN != "hidden")):
                if on and got is None:
                    yield f"rank {{rank}}'s {{what}} receive no gradient where max |grad| {{want.abs().max():.3g}} is expected"
                elif on and (found := off(got, want, tol + want.abs().max() * torch.finfo(got.dtype).eps))[0].any():
                    rows = found[0].any(-1).nonzero().flatten().tolist()
                    yield f"rank {{rank}}'s gradient of its {{what}} is wrong in row(s) {{rows}}: {{found[1]}}"''')


FLOPS_RUN = '''
def run(fn, rank, group):
    """The matmul FLOPs of the call and its backward (torch's FlopCounterMode), with the FROZEN input
    frozen and with both trainable, each a call of its own."""
    hidden, weight, tokens, w_lp, w_ent = inputs()
    flops = []
    for frozen in (FROZEN, "none"):
        h = hidden.clone().requires_grad_(frozen != "hidden")
        shard = weight[rank * V_LOCAL:(rank + 1) * V_LOCAL].clone().requires_grad_(frozen != "weight")
        with FlopCounterMode(display=False) as counter:
            log_prob, entropy = CALL
            (w_lp * log_prob.reshape(-1)).sum().backward()
        flops.append(counter.get_total_flops())
    return {"flops": flops}'''

FLOPS = code('''
    def judge(results):
        """Not computing the frozen input's gradient saves one product of 2*T*V_LOCAL*H FLOPs (half required)."""
        product = 2 * T * V_LOCAL * H
        return [f"rank {rank}: {r['flops'][0]:,} matmul FLOPs with the {FROZEN} frozen, {r['flops'][1]:,} with both "
                f"trainable: the frozen {FROZEN}'s gradient ({product:,} FLOPs) is computed and dropped"
                for rank, r in enumerate(results) if r["flops"][1] - r["flops"][0] < product // 2]''')


def refuse(case: Any) -> str | None:
    if case.hidden_view != "contiguous":
        return "scripts hand over contiguous hidden states (hidden_view=contiguous)"
    if case.regime not in ("normal", "wide"):
        return "scripts draw normal or wide logits"
    return None


LINEAR_SCRIPT = LevelScript(
    checks=("values", "gradients", "crash", "empty-input", "frozen-input-work", "memory-logits-dtype"),
    write=write,
    refuse=refuse,
    alone=("gradients",),
    exempt=lambda case: (case.H,),
)
