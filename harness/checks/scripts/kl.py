"""The KL-estimator level's stand-alone scripts (`KL_SCRIPT`): the policy's and the reference's
log-probs `[T]` handed to `kl_estimate` as a trainer's KL loss hands them (the policy's a leaf that
requires grad), judged against the float64 estimate of the same inputs (`reference/kl.py`'s math in a
few lines), its gradient w.r.t. the policy's log-probs, its finiteness, its flags, or its shape and
dtype.

The inputs are the case's: its seed drawn in the order `cases/kl.py` draws it, with only the case's
own regime, clamp and mask written out, so that a script's tokens are the harness's. The level has
no vocabulary and no shards: every script runs at TP 1, in its own process.

Named for its level, as `checks/kl.py` judges it and `reference/kl.py` is its oracle.
"""
from __future__ import annotations

import re
import textwrap
from typing import Any

from harness.checks.scripts import ANY, LevelScript, Parts, code, dtype

# The log-ratios `x` of the case's regime (float64 [T], from `g`), as `cases/kl.py` draws them.
REGIME = {
    "normal": "x = 0.3 * torch.randn(T, generator=g, dtype=torch.float64)  # a policy near its reference",
    "wide": "x = 3.0 * torch.randn(T, generator=g, dtype=torch.float64)  # log-ratios of a few units",
    "zero": "x = 0 * torch.randn(T, generator=g, dtype=torch.float64)  # the policy is its reference: every log-ratio 0",
    "fartail": """x = 0.3 * torch.randn(T, generator=g, dtype=torch.float64)
    far = torch.rand(T, generator=g) < 0.5  # about half the tokens (one at least) far out: |log-ratio| 20 to 20 + REACH
    far[torch.randint(0, T, (1,), generator=g)] = True
    x = torch.where(far, (20 + REACH * torch.rand(T, generator=g, dtype=torch.float64)) * (1 - 2 * (torch.rand(T, generator=g) < 0.5)), x)""",
}
# The case's mask (the harness draws one rand(T) for any mask given, whatever it is).
MASK = {
    "none": "mask = None  # every token valid",
    "all": "mask = torch.rand(T, generator=g) >= 0  # a bool mask, every token valid",
    "empty": "mask = torch.rand(T, generator=g) < 0  # a bool mask with no valid token",
    "random": "mask = torch.rand(T, generator=g) < 0.7  # a bool mask, ~70% valid\n    mask[:1] |= ~mask.any()  # one at least",
}
MASK["float"] = MASK["random"].replace("a bool mask", "as a 0/1 float32 mask (verl's response_mask)")
MASKS = {"none": "no mask", "all": "a bool mask with every token valid", "random": "a random bool mask",
         "float": "a random 0/1 float mask", "empty": "a mask with no valid token"}
# Per kind: the float64 estimate of the log-ratio `x`, and the magnitudes whose float32 roundings bound
# its value and its derivative (docs/kl.md, Tolerance: the harness allows 4 roundings of each, a script 16).
ESTIMATE = {"k1": "x", "k2": "x * x / 2", "k3": "torch.expm1(-x) + x"}
SCALE = {"k1": ("x.abs()", "1"), "k2": ("x * x", "x.abs()"),
         "k3": ("torch.exp(-x) * (x.abs() + 5) + 2 * (1 + x.abs())", "torch.exp(-x) * (x.abs() + 4) + 1")}


def reduce(case: Any, v: str) -> str:
    """`v` (per token, 0 at masked tokens) reduced as the case reduces the estimates."""
    return {"none": v, "sum": f"{v}.sum()", "token_mean": f"{v}.sum() / max(int(keep.sum()), 1)"}[case.reduction]


def clamped(case: Any) -> str:
    """The log-ratios `r` as the estimator takes them."""
    return f"r.clamp(-{case.clamp:g}, {case.clamp:g})" if case.clamp else "r"


def describe(case: Any) -> str:
    """What the routine returns, in words: the estimator, its clamp, its reduction, the mask, the dtype."""
    what = f"the {case.kind} estimate" + (f" of the log-ratio clamped to [-{case.clamp:g}, {case.clamp:g}]" if case.clamp else "")
    what = {"none": f"{what} per token", "sum": f"the sum of {what} over the valid tokens",
            "token_mean": f"the token mean of {what} over the valid tokens"}[case.reduction]
    return f"{what} ({MASKS[case.mask]}{', bf16 log-probs' if case.dtype == 'bf16' else ''})"


def inputs(case: Any) -> str:
    near = (f"\n    lp = torch.where(((lp.double() - ref.double()).abs() - {case.clamp:g}).abs() < 1e-3 * (1 + {case.clamp:g}), "
            "ref, lp)  # none at the clamp's edge") if case.clamp else ""
    regime = REGIME[case.regime].replace("REACH", "40" if case.clamp is None else "180")
    return f'''
def inputs():
    """The policy's and the reference's log-probs [T] (both <= 0), the mask and the loss's weight, from SEED."""
    g = torch.Generator().manual_seed(SEED)
    base = -torch.randn(T, generator=g, dtype=torch.float64).abs() * 1.5  # the larger log-prob of each token
    {regime}
    lp, ref = (base + x.clamp(max=0)).to({dtype(case)}), (base - x.clamp(min=0)).to({dtype(case)}){near}
    {MASK[case.mask]}
    return lp, ref, mask{".float()" if case.mask == "float" else ""}, torch.randn({"T" if case.reduction == "none" else "()"}, generator=g)'''


def reference(case: Any) -> str:
    """`reference(lp, ref, mask)`: the float64 answer, its bound, the (unclamped) log-ratios, the valid tokens."""
    spread = " + T * per.abs()" if case.reduction != "none" else ""  # a sum's roundings, in any order
    keep = "torch.ones(T, dtype=torch.bool)" if case.mask == "none" else "mask != 0"
    return f'''
def reference(lp, ref, mask):
    """The float64 {case.kind} estimate, masked and reduced; its float32 rounding bound, the log-ratios, the valid tokens."""
    r = lp.double() - ref.double()
    x, keep = {clamped(case)}, {keep}
    per = torch.where(keep, {ESTIMATE[case.kind]}, 0)
    bound = torch.where(keep, 16 * 2**-24 * ({SCALE[case.kind][0]}{spread}), 0)
    return {reduce(case, "per")}, {reduce(case, "bound")}, r.detach(), keep'''


# Where a routine's output misses its float64 answer: per token (its log-ratio, masked or not) or, for
# a reduction, with the count of valid tokens.
MISSED = code('''
    def missed(got, want, tol, r, keep):
        """Whether `got` misses the float64 `want` by more than `tol` (NaN included); where, and how."""
        got = got.detach().double().reshape(want.shape)
        i = (~((got - want).abs() <= tol) & (got != want)).reshape(-1).nonzero().flatten().tolist()
        show = lambda t: [float(f"{v:.6g}") for v in t.reshape(-1)[i].tolist()]  # noqa: E731
        at = f" at token(s) {i} (log-ratio(s) {show(r)}; masked: {[j for j in i if not keep[j]]})" if want.dim() else f" ({int(keep.sum())} of {len(keep)} tokens valid)"
        return bool(i), f"{at}: {show(got)} where {show(want)} is expected"''')

GRADIENT = '''
    lp, ref, mask, w = inputs()
    a = lp.double().requires_grad_()
    want, tol, r, keep = reference(a, ref, mask)
    grad = torch.autograd.grad((want * w.double()).sum(), a)[0]'''


def judge(case: Any, check: str) -> str:
    what = describe(case)
    why = " (a mean over no valid token is 0 / 0 unless its count is floored at 1)" \
        if case.mask == "empty" and case.reduction == "token_mean" else ""
    if check == "values":
        return f'''
def judge(results):
    """The estimate against its float64 value from the same inputs."""
    want, tol, r, keep = reference(*inputs()[:3])
    for res in results:
        if (found := missed(res["out"], want, tol, r, keep))[0]:
            yield f"{what} is wrong{{found[1]}}{why}"'''
    if check == "gradients":
        scale = SCALE[case.kind][1] if case.clamp else re.sub(r"\bx\b", "r", SCALE[case.kind][1])
        clamp = f"\n    x = {clamped(case)}" if case.clamp else ""
        count = " / max(int(keep.sum()), 1)" if case.reduction == "token_mean" else ""
        return f'''
def judge(results):
    """The gradient of sum(w * estimate) w.r.t. the policy's log-probs, against float64 autograd."""{GRADIENT}{clamp}
    tol = 16 * 2**-24 * ({scale}) * w.abs() * keep{count} + grad.abs() * torch.finfo(lp.dtype).eps
    for res in results:
        if (found := missed(res["grad"] if res["grad"] is not None else 0 * grad, grad, tol, r, keep))[0]:
            yield f"the gradient of sum(w * {what}) w.r.t. the policy's log-probs is wrong{{found[1]}}" + (res["grad"] is None) * " (none reaches them)"'''
    if check == "finite":
        return f'''
def judge(results):
    """NaN or inf in the estimate or its gradient where the float64 answer is finite."""{GRADIENT}
    for res in results:
        for name, got, exp in (("{what}", res["out"], want.detach()), ("its gradient w.r.t. the policy's log-probs", res["grad"], grad)):
            if got is not None and (found := missed(got, exp, 1e308, r, keep))[0]:
                yield f"{{name}} is not finite{{found[1]}}{why}"'''
    if check == "grad-flags":
        return f'''
def judge(results):
    """The estimate requires grad exactly when the policy's log-probs do (autograd on)."""
    for res in results:
        if res["requires_grad"] != {case.requires_grad}:
            yield f"{what} has requires_grad={{res['requires_grad']}}, where {case.requires_grad} is expected: the policy's log-probs require grad={case.requires_grad}, autograd on"'''
    shape, said = ("[T]", f"[{case.T}]") if case.reduction == "none" else ("[]", "[] (a 0-dim scalar)")
    return f'''
def judge(results):
    """The estimate float32 {shape} whatever the log-probs' dtype; the gradient in the policy's log-probs' dtype and shape."""
    for res in results:
        if (res["out"].dtype, list(res["out"].shape)) != (torch.float32, {shape}):
            yield f"{what} is {{res['out'].dtype}}{{list(res['out'].shape)}}, where torch.float32{said} is expected"
        if res["grad"] is not None and (res["grad"].dtype, list(res["grad"].shape)) != ({dtype(case)}, [T]):
            yield f"the gradient w.r.t. the policy's log-probs is {{res['grad'].dtype}}{{list(res['grad'].shape)}}, where {dtype(case)}[{case.T}] (the log-probs') is expected"'''


ABOUT = {"values": "a wrong value of {what}", "gradients": "a wrong gradient of {what} w.r.t. the policy's log-probs",
         "finite": "NaN or inf in {what} or its gradient where the answer is finite",
         "grad-flags": "a wrong requires_grad of {what}", "shapes-dtypes": "a wrong shape or dtype of {what}"}


def write(case: Any, check: str, term: str, memory: bool) -> Parts:
    if check == "gradients" and not case.grad_on:
        raise ValueError("the case's policy log-probs take no gradient (requires_grad=0): no gradient to check")
    backward = check in ("gradients", "finite", "shapes-dtypes") and case.grad_on
    after = "\n    if out.requires_grad and out.shape == w.shape:\n        (out * w.to(out.dtype)).sum().backward()" \
        if backward else ""
    run = f'''
def run(fn, rank, group):
    """The policy's log-probs a leaf that {"requires" if case.requires_grad else "does not require"} grad, the reference's not; the call{"; the backward of sum(w * estimate)" if backward else ""}."""
    lp, ref, mask, w = inputs()
    lp.requires_grad_({case.requires_grad})
    out = CALL{after}
    return {{"out": out.detach(), "requires_grad": out.requires_grad, "grad": lp.grad}}'''
    judged = judge(case, check)
    helpers = [reference(case)] if "reference(" in judged else []
    helpers += [MISSED] if "missed(" in judged else []
    args = {"log_probs": ("lp", ANY), "ref_log_probs": ("ref", ANY), "kind": (repr(case.kind), case.kind),
            "mask": ("mask", ANY) if case.mask != "none" else ("None", None),
            "reduction": (repr(case.reduction), case.reduction), "clamp": (repr(case.clamp), case.clamp)}
    return Parts("\n\n\n".join(textwrap.dedent(h).strip("\n") for h in (inputs(case), *helpers)), run, judged, args,
                 ABOUT[check].format(what=describe(case)))


def refuse(case: Any) -> str | None:
    if case.T == 0:
        return "a call on no token (T=0) is the empty-input check's, which KL scripts do not write: they draw T >= 1 tokens"
    return None


KL_SCRIPT = LevelScript(
    checks=("values", "gradients", "grad-flags", "finite", "shapes-dtypes"),
    write=write,
    refuse=refuse,
)
