"""The fused-linear distillation level's stand-alone scripts (`LINEAR_DISTILL_SCRIPT`): the student's
hidden states and head (leaves that require grad), the teacher's hidden states and head (or its
logits) and labels with ignored tokens, handed to the routine as its trainer hands them; the loss (or
its gradients) judged against the float64 loss of the whole batch. A wrong loss is matched against
the known ways to get it wrong (the ignored tokens distilled, a mean over every token, a mean per
chunk), so the message names the cause where it is one of them.

Named for its level, as `checks/linear_distill.py` judges it and `reference/linear_distill.py` is its oracle.
"""
from __future__ import annotations

from typing import Any

from harness.checks.scripts import ANY, LevelScript, Parts, code, dtype
from harness.checks.scripts.distill import DIVERGENCE, KL

_TEACHER = {"head": "", "logits": "\n    ht, wt = (ht.double() @ wt.double().T).to(ht.dtype), None  # the teacher's logits"}
_LABELS = {"all": "", "random": "labels[torch.rand(T, generator=g) > 0.7] = -100  # ignored tokens (prompt, padding)",
           "empty": "labels[:] = -100  # no valid label in the batch"}
_REGIME = {"peaked": "ht[torch.arange(T), 0] += 12; wt[:, 0] = torch.where(torch.arange(V) == 0, 1.0, 0.0)  # a confident teacher",
           "disjoint": "ht, wt = torch.cat([hs, 0 * ht[:, H:]], 1), torch.cat([-2 * ws, wt[:, H:]], 1)  # the teacher's top ids the student's bottom",
           "self": "ht, wt = torch.cat([hs, 0 * ht[:, H:]], 1), torch.cat([ws, wt[:, H:]], 1)  # the teacher is the student"}


def write(case: Any, check: str, term: str, memory: bool) -> Parts:
    backward = check in ("gradients", "finite", "crash")
    mix = "\n    lm = (BETA * lt.exp() + (1 - BETA) * ls.exp()).log()" if case.kind == "jsd" else ""
    inputs = f'''
def inputs():
    """The student's hidden states and head, the teacher's, labels (-100: ignored), the loss's weight."""
    g = torch.Generator().manual_seed(SEED)
    hs, ws = torch.randn(T, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64) * 2 / H ** 0.5
    ht, wt = torch.randn(T, HT, generator=g, dtype=torch.float64), torch.randn(V, HT, generator=g, dtype=torch.float64) * 2 / HT ** 0.5
    {_REGIME.get(case.regime, "")}
    labels = torch.randint(0, V, (T,), generator=g)
    {_LABELS[case.labels]}
    return [x.to({dtype(case)}) for x in (hs, ws, ht, wt)] + [labels, torch.randn((), generator=g).item()]


def reference(hs, ws, ht, wt, labels, every=False):
    """The float64 loss: the divergence at the temperature and the cross-entropy at 1, over the valid tokens."""
    s, t = hs @ ws.T, ht if wt is None else ht @ wt.T
    ls, lt = torch.log_softmax(s / TEMPERATURE, -1), torch.log_softmax(t / TEMPERATURE, -1){mix}
    kl = {KL}
    soft, hard = {DIVERGENCE[case.kind]}, -s.log_softmax(-1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    return (HARD * hard[(keep := labels != -100)].sum() + SOFT * soft[keep | every].sum()) / max(int(keep.sum()), 1)'''
    after = "\n    (out * w).backward()" if backward else ""
    run = f'''
def run(fn, rank, group):
    """The call with the student's inputs as leaves that require grad{"; the backward of weight * loss" if backward else ""}."""
    hs, ws, ht, wt, labels, w = inputs()
    hs, ws = hs.clone().requires_grad_(), ws.clone().requires_grad_(){_TEACHER[case.teacher]}
    out = CALL{after}
    return {{"out": out.detach(), "hidden": hs.grad, "head": ws.grad}}'''
    judge = {"values": VALUES, "gradients": GRADIENTS, "finite": FINITE}.get(check, NONE)
    args = {"student_hidden": ("hs", ANY), "student_weight": ("ws", ANY), "teacher_hidden": ("ht", ANY),
            "teacher_weight": ("wt", ANY), "labels": ("labels", ANY), "kind": (repr(case.kind), case.kind),
            "beta": (repr(case.beta), case.beta), "temperature": (repr(case.temperature), case.temperature),
            "ignore_index": ("-100", -100), "hard_weight": (repr(case.hard_weight), case.hard_weight),
            "soft_weight": (repr(case.soft_weight), case.soft_weight), "chunk_size": (repr(case.chunk_size), case.chunk_size)}
    about = {"values": f"a wrong {case.kind} distillation loss", "gradients": "a wrong gradient of the distillation loss",
             "finite": "a non-finite distillation loss or gradient", "crash": "the call or its backward raises"}[check]
    about += (f", {case.dtype} inputs" if case.dtype != "fp32" else "") + \
        (f", temperature {case.temperature}" if case.temperature != 1.0 else "") + \
        (f", chunks of {case.chunk_size} tokens" if case.chunk_size > 0 else "")
    return Parts(inputs, run, judge, args, about, {
        "H": case.H, "HT": case.teacher_hidden_size, "BETA": case.beta, "TEMPERATURE": case.temperature,
        "HARD": case.hard_weight, "SOFT": case.soft_weight, "CHUNK": case.chunk_size})


# The gradients' bound: float32 rounding at the logits' scale, and one rounding of the logits to the inputs' dtype.
TOL = "tol = (64 * 2**-24 + torch.finfo(hs.dtype).eps) * (3 * (hs.double() @ ws.double().T).abs().max() + math.log(V))"

# The loss's bound, first order: each logit may carry its float32 matmul's error and one rounding to the
# inputs' dtype (a head's logits come out in it), and the loss moves by |dloss/dlogit| times that; plus
# float32 rounding of the terms. Arithmetic in bf16 after bf16 logits goes beyond it.
BOUND = code('''
    def bound(x, labels, dtype, u=64 * 2**-24):
        """The loss's first-order error bound: each logit's matmul error and rounding to `dtype`, times |dloss/dlogit|."""
        s, t = (x[0] @ x[1].T).requires_grad_(), (x[2] @ x[3].T).requires_grad_()  # the logits, as leaves
        gs, gt = torch.autograd.grad(reference(s, torch.eye(V, dtype=torch.float64), t, None, labels), (s, t))
        return u * (3 * s.abs().max() + math.log(V)) + sum((g.abs() * (u * a.abs() @ b.abs().T + torch.finfo(dtype).eps * z.abs())).sum()
                                                            for g, z, a, b in ((gs, s, *x[:2]), (gt, t, *x[2:4])))''')

VALUES = code('''
    def judge(results):
        """The loss against the float64 loss; a miss matched against the usual causes."""
        hs, ws, ht, wt, labels, w = inputs()
        x, n = [v.double() for v in (hs, ws, ht, wt)] + [labels], int((labels != -100).sum())
        want, got, tol = reference(*x), results[0]["out"].double(), bound(x, labels, hs.dtype)
        if not (got - want).abs() <= tol:
            chunks = [reference(*[v[i:i + CHUNK] if v.shape[0] == T else v for v in x]) for i in range(0, T, CHUNK)] if CHUNK > 0 else []
            every = reference(*x, every=True)
            causes = {"the ignored tokens are distilled too": every, "it is divided by all T tokens, not the valid ones": want * max(n, 1) / T,
                      "the ignored tokens are distilled too, and it is divided by all T tokens": every * max(n, 1) / T,
                      "each chunk is averaged over its own valid tokens": sum(chunks) / max(len(chunks), 1)}
            why = next((f": {k}" for k, v in causes.items() if (got - v).abs() <= tol), "")
            yield f"the loss is {got:.6g} where {want:.6g} is expected over {n} valid of {T} tokens (|error| {(got - want).abs():.3g}, bound {tol:.2g}: one rounding of each logit to {hs.dtype}, float32 after it){why}"''') + "\n\n\n" + BOUND

GRADIENTS = code(f'''
    def judge(results):
        """The gradients of weight * loss w.r.t. the student's hidden states and head, against float64 autograd."""
        hs, ws, ht, wt, labels, w = inputs()
        x = [hs.double().requires_grad_(), ws.double().requires_grad_(), ht.double(), wt.double(), labels]
        want = dict(zip(("hidden", "head"), torch.autograd.grad(w * reference(*x), x[:2])))  # float64 autograd
        {TOL} * abs(w) * max(H, V)
        for name, what in (("hidden", "hidden states"), ("head", "LM head")):
            if results[0][name] is None:
                yield f"the student's {{what}} receive no gradient where max |grad| {{want[name].abs().max():.3g}} is expected"
            elif (found := off(results[0][name], want[name], tol))[0].any():
                yield f"the gradient of the student's {{what}} is wrong in {{'token' if name == 'hidden' else 'vocabulary'}} rows {{found[0].any(-1).nonzero().flatten().tolist()}}: {{found[1]}}"''')

FINITE = code('''
    def judge(results):
        """No NaN or inf in the loss or its gradients (no valid label: the loss is 0)."""
        labels, n = inputs()[4], int((inputs()[4] != -100).sum())
        for name, value in results[0].items():
            if value is not None and not value.isfinite().all():
                yield f"the {'loss' if name == 'out' else 'gradient of the student ' + name} is not finite over {n} valid of {T} tokens" + \\
                    (": a mean over no valid token must be 0, not 0 / 0" if n == 0 else "")''')

NONE = code('''
    def judge(results):
        """Only whether the call and its backward run."""
        return []''')


LINEAR_DISTILL_SCRIPT = LevelScript(
    checks=("values", "gradients", "finite", "crash"),
    write=write,
)
