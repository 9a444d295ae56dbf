"""The distillation level's stand-alone scripts (`DISTILL_SCRIPT`): one rank's shard of the student's
(and a full teacher's) logits handed to `distill_divergence` or `distill_log_softmax`, judged against
the float64 divergence (or log-softmax) of the whole rows.

Named for its level, as `checks/distill.py` judges it and `reference/distill.py` is its oracle.
"""
from __future__ import annotations

from typing import Any

from harness.checks.scripts import ANY, LevelScript, Parts, code, dtype
from harness.checks.scripts.kernel import EMPTY, NONE

# The float64 per-token divergence of the student's log-probs `ls` from the teacher's `lt` (each
# [T, V] at the temperature), by kind, as script code (docs/contract.md, Level 3).
KL = "(lambda a, b: (a.exp() * (a - b)).nan_to_num(0, 0, 0).sum(-1))"
DIVERGENCE = {
    "forward_kl": "kl(lt, ls)",
    "reverse_kl": "kl(ls, lt)",
    "mixed": "BETA * kl(lt, ls) + (1 - BETA) * kl(ls, lt)",
    "soft_ce": "-(lt.exp() * ls).nan_to_num(0, 0, 0).sum(-1)",
    "jsd": "BETA * kl(lt, lm) + (1 - BETA) * kl(ls, lm)",
}


def answer(case: Any) -> str:
    """The float64 output of the case's function, from the float64 logits `s` and `t`: over the whole
    vocabulary, or over the teacher's top-k `ids` (renormalized over them or not), the teacher's
    log-probs there its own or, for a given teacher, its pass's float32 ones (`teacher_pass`)."""
    if case.function == "log_softmax":
        return "torch.log_softmax(s / TEMPERATURE, -1)"
    mix = "\n    lm = (BETA * lt.exp() + (1 - BETA) * ls.exp()).log()" if case.kind == "jsd" else ""
    if case.teacher == "full":
        pair = "ls, lt = torch.log_softmax(s / TEMPERATURE, -1), torch.log_softmax(t / TEMPERATURE, -1)"
    else:
        on = (lambda z: f"{z}.gather(-1, ids).log_softmax(-1)") if case.renormalize else \
            (lambda z: f"{z}.log_softmax(-1).gather(-1, ids)")
        given = "(teacher_pass(t)[0].double() / TEMPERATURE).log_softmax(-1)" if case.renormalize else \
            "teacher_pass(t)[0].double()"
        pair = (f"ids = t.topk(K, -1).indices  # the teacher's top-k: the support\n"
                f"    ls, lt = {on('(s / TEMPERATURE)')}, {given if case.teacher == 'given' else on('(t / TEMPERATURE)')}")
    return f"{pair}{mix}\n    kl = {KL}\n    return {DIVERGENCE[case.kind]}"


# The arguments that hand the divergence its teacher, by the case's teacher form.
TEACHER_ARGS = {"full": ("teacher_logits",), "topk": ("teacher_logits", "k"),
                "given": ("teacher_topk_log_probs", "teacher_topk_indices")}

TEACHER_PASS = code('''
def teacher_pass(t):
    """A teacher pass's top-k: float32 log-probs at its K largest logits, and their global ids."""
    return t.double().log_softmax(-1).gather(-1, ids := t.double().topk(K, -1).indices).float(), ids''')


def write(case: Any, check: str, term: str, memory: bool) -> Parts:
    shard = "rank * V_LOCAL:(rank + 1) * V_LOCAL"
    backward = check != "values" and case.has_backward
    weights = f"w[:, {shard}]" if case.function == "log_softmax" else "w"
    after = f"\n    (out * {weights}).sum().backward()" if backward else ""
    w = "torch.randn(T, V, generator=g)" if case.function == "log_softmax" else "torch.randn(T, generator=g)"
    body = answer(case)
    reference = f"def reference(s, t):\n    \"\"\"The float64 {case.function} of the whole rows.\"\"\"\n    " + \
        (body if "return" in body else f"return {body}")
    # The sharded log-softmax's offsets show at the shards' edges: its inputs have them on top. A
    # divergence's are left as drawn (a planted peak would make the other shards' share of the
    # gradient vanish, and with it a shard-local normaliser's defect).
    plant = case.function == "log_softmax"
    given = case.function == "divergence" and case.teacher == "given"
    passed, pass_call = ("\n\n\n" + TEACHER_PASS, "\n    tl, ti = teacher_pass(t)") if given else ("", "")
    inputs = f'''
def inputs():
    """The student's and the teacher's logits [T, V]{" (the shards' edges planted on top)" if plant else ""}, the loss's weights."""
    g = torch.Generator().manual_seed(SEED)
    s, t = torch.randn(T, V, generator=g, dtype=torch.float64) * 2, torch.randn(T, V, generator=g, dtype=torch.float64) * 2
    {"s[torch.arange(T), torch.randint(0, V, (T,), generator=g)] += 12  # one confident entry per row" if case.regime == "peaked" else ""}
{PLANT if plant else ""}    return s.to({dtype(case)}), t.to({dtype(case)}), {w}


{reference}{passed}'''
    run = f'''
def run(fn, rank, group):
    """Rank `rank`'s shards of the student's logits (a leaf that requires grad) and the teacher's; the call{"; the backward" if backward else ""}."""
    s, t, w = inputs()
    student = s[:, {shard}].clone().requires_grad_({case.requires_grad}){pass_call}
    out = CALL{after}
    return {{"out": out, "grad": student.grad}}'''
    judge = {"values": VALUES, "gradients": GRADIENTS}.get(check, EMPTY if check == "empty-input" else NONE)
    args = {"student_logits": ("student", ANY), "logits": ("student", ANY), "tp_group": ("group", ANY),
            "teacher_logits": (f"t[:, {shard}]", ANY), "teacher_topk_log_probs": ("tl", ANY),
            "teacher_topk_indices": ("ti", ANY), "k": (repr(case.k), case.k), "kind": (repr(case.kind), case.kind),
            "beta": (repr(case.beta), case.beta), "temperature": (repr(case.temperature), case.temperature),
            "renormalize": (repr(case.renormalize), case.renormalize), "chunk_size": (repr(case.chunk_size), case.chunk_size)}
    teacher = TEACHER_ARGS[case.teacher]
    args = {k: v for k, v in args.items() if k not in ("teacher_logits", "teacher_topk_log_probs", "teacher_topk_indices",
                                                       "k", "renormalize") or k in teacher
            or k == "renormalize" and case.teacher != "full"}
    if case.function == "log_softmax":
        args = {k: args[k] for k in ("logits", "tp_group", "temperature", "chunk_size")}
    else:
        del args["logits"]
    what = "divergence" if case.function == "divergence" else "log-softmax"
    about = {"values": f"a wrong {case.kind if what == 'divergence' else what}",
             "gradients": f"a wrong gradient of the {case.kind if what == 'divergence' else what} w.r.t. the student's logits",
             "crash": "the call or its backward raises", "empty-input": "a call on no rows fails"}[check]
    about += f" at TP {case.tp}" + (f", {case.dtype} logits" if case.dtype != "fp32" else "") + \
        (f", temperature {case.temperature}" if case.temperature != 1.0 else "")
    vocab = case.tp * case.v_local
    edges = sorted({i for n in (1, 2, 4, 8) if vocab % n == 0 for r in range(n)
                    for i in (r * (vocab // n), (r + 1) * (vocab // n) - 1)})[:case.T]
    return Parts(inputs, run, judge, args, about, {"BETA": case.beta, "TEMPERATURE": case.temperature, "K": min(case.k, case.tp * case.v_local),
                                                   **({"EDGES": edges} if plant else {})})


VALUES = code('''
    def judge(results):
        """Each rank's output against the float64 answer of the whole rows."""
        s, t, w = inputs()
        want, x = reference(s.double(), t.double()), s.double()
        for rank, r in enumerate(results):
            mine = want if want.dim() == 1 else want[:, rank * V_LOCAL:(rank + 1) * V_LOCAL]
            if (found := off(r["out"], mine, 64 * 2**-24 * (x[x.isfinite()].abs().max() + math.log(V))))[0].any():
                rows = (found[0] if found[0].dim() == 1 else found[0].any(-1)).nonzero().flatten().tolist()
                yield f"rank {rank}'s output is wrong in row(s) {rows}: {found[1]}"''')

GRADIENTS = code('''
    def judge(results):
        """The gradient each rank's shard of the student's logits receives, against float64 autograd."""
        s, t, w = inputs()
        x = s.double().requires_grad_()
        want = torch.autograd.grad((reference(x, t.double()) * w.double()).sum(), x)[0]
        tol = 64 * 2**-24 * (x[x.isfinite()].abs().max() + math.log(V)) * w.abs().max() + want.abs().max() * torch.finfo(s.dtype).eps
        for rank, r in enumerate(results):
            shard = want[:, rank * V_LOCAL:(rank + 1) * V_LOCAL]
            if r["grad"] is None:
                yield f"rank {rank}'s shard receives no gradient where max |grad| {shard.abs().max():.3g} is expected"
            elif (found := off(r["grad"], shard, tol))[0].any():
                rows = found[0].any(-1).nonzero().flatten().tolist()
                yield f"rank {rank}'s shard of the student's gradient is wrong in row(s) {rows}: {found[1]}"''')


PLANT = '''    for row, (a, b) in enumerate(zip(EDGES, reversed(EDGES))):
        s[row, a], t[row, b] = s[row].max() + 8, t[row].max() + 8
'''


def refuse(case: Any) -> str | None:
    if case.layout != "contiguous":
        return "scripts hand over the student's logits contiguous (layout at its default)"
    if case.function not in ("divergence", "log_softmax"):
        return "scripts call distill_divergence or distill_log_softmax"
    if case.function == "divergence" and case.teacher != "full" and case.dtype != "fp32":
        return "a top-k teacher's script runs on float32 logits (ties of half-precision logits leave the support open)"
    if case.regime not in ("normal", "peaked") or case.teacher_grad or case.self_teacher:
        return "scripts draw normal or peaked logits, a teacher without gradient, not the student itself"
    return None


DISTILL_SCRIPT = LevelScript(
    checks=("values", "gradients", "crash", "empty-input"),
    write=write,
    refuse=refuse,
    required=lambda case: TEACHER_ARGS[case.teacher] if case.function == "divergence" else (),
)
