"""Single-process checks of the built-in targets (fused and naive) against a float64 oracle.

No torch.distributed initialisation: ``tp_group=None`` means a single rank, V_local == V.
"""

from __future__ import annotations

import math
import zlib
from types import SimpleNamespace

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from harness.targets import fused, naive
from harness.targets.fused import FusedLogProbEntropy

TARGETS = {"fused": fused, "naive": naive}
EPS32 = 2.0**-24


# ---------------------------------------------------------------------------- helpers
def make_logits(T, V, seed, *, peaked=True, neg_inf=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, V, generator=g, dtype=torch.float64) * 3.0
    if peaked and T and V:
        hot = torch.randint(0, V, (T,), generator=g)
        x[torch.arange(T), hot] += 20.0
    if neg_inf and T and V > 2:
        drop = torch.rand(T, V, generator=g) < 0.3
        drop[:, 0] = False  # keep every row finite somewhere
        x[drop] = float("-inf")
    return x


def make_tokens(T, V, seed, x=None):
    g = torch.Generator().manual_seed(seed + 1)
    t = torch.randint(0, V, (T,), generator=g)
    if x is not None and T:
        # targets on finite entries (a -inf target has log-prob -inf in the oracle too)
        finite = torch.isfinite(x)
        for i in range(T):
            if not finite[i, t[i]]:
                t[i] = 0
    return t


def make_mask(kind, T, V, tokens, seed):
    if kind == "none":
        return None
    g = torch.Generator().manual_seed(seed + 2)
    keep = torch.rand(T, V, generator=g) < 0.5
    if kind == "drop_target" and T:
        keep[torch.arange(T), tokens] = False
    return keep


def oracle(x64, tokens, keep, with_entropy, entropy_grad, w1, w2):
    """float64 log-prob / entropy and the gradient of sum(w1 lp) + [sum(w2 H)]."""
    x = x64.detach().clone().requires_grad_(True)
    T = x.shape[0]
    if keep is not None:
        k = keep.clone()
        k[torch.arange(T), tokens] = True
        xm = x.masked_fill(~k, float("-inf"))
    else:
        xm = x
    lp = torch.log_softmax(xm, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    log_p = torch.log_softmax(x, dim=-1)
    p = log_p.exp()
    ent = -(p * torch.where(p > 0, log_p, torch.zeros_like(log_p))).sum(-1)
    loss = (w1 * lp).sum()
    if with_entropy and entropy_grad:
        loss = loss + (w2 * ent).sum()
    (grad,) = torch.autograd.grad(loss, x) if T else (torch.zeros_like(x),)
    return lp.detach(), ent.detach(), grad


def tol32(x64, V, k=8.0):
    finite = x64[torch.isfinite(x64)]
    amax = float(finite.abs().max()) if finite.numel() else 0.0
    return k * EPS32 * (amax + math.log(max(V, 2)))


def close(actual, expected, atol, what):
    a = actual.detach().double()
    both_inf = torch.isinf(a) & torch.isinf(expected) & (torch.sign(a) == torch.sign(expected))
    err = torch.where(both_inf, torch.zeros_like(a), (a - expected).abs())
    assert not torch.isnan(err).any(), f"{what}: NaN"
    assert float(err.max()) <= atol if err.numel() else True, (
        f"{what}: max err {float(err.max()):.3e} > {atol:.3e}")


# ---------------------------------------------------------------------------- Level 1 values
@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [-1, 1, 3, 64])
@pytest.mark.parametrize("mask_kind", ["none", "random", "drop_target"])
@pytest.mark.parametrize("ent_mode", ["off", "grad", "metric"])
def test_kernel_matches_float64_oracle(target, dtype, chunk, mask_kind, ent_mode):
    mod = TARGETS[target]
    T, V = 7, 37
    seed = zlib.crc32(repr((dtype, chunk, mask_kind, ent_mode)).encode()) % 1000
    logits = make_logits(T, V, seed).to(dtype).requires_grad_(True)
    x64 = logits.detach().double()
    tokens = make_tokens(T, V, seed)
    keep = make_mask(mask_kind, T, V, tokens, seed)
    with_entropy = ent_mode != "off"
    with_entropy_grad = ent_mode == "grad"
    g = torch.Generator().manual_seed(seed + 3)
    w1 = torch.rand(T, generator=g, dtype=torch.float64) * 2 - 1
    w2 = torch.rand(T, generator=g, dtype=torch.float64) * 2 - 1

    before = logits.detach().clone()
    v_logits, v_tokens = logits._version, tokens._version
    keep_before = keep.clone() if keep is not None else None
    v_keep = keep._version if keep is not None else None

    lp, ent = mod.calculate_log_probs_and_entropy(
        logits, tokens, None, with_entropy=with_entropy, chunk_size=chunk,
        log_prob_keep_mask=keep, with_entropy_grad=with_entropy_grad)
    e_lp, e_ent, e_grad = oracle(x64, tokens, keep, with_entropy, with_entropy_grad, w1, w2)

    atol = tol32(x64, V)
    assert lp.dtype == torch.float32 and lp.numel() == T
    close(lp.reshape(-1), e_lp, atol, "log_prob")
    assert lp.requires_grad
    if with_entropy:
        assert ent.dtype == torch.float32 and ent.shape == (T,)
        close(ent, e_ent, atol, "entropy")
        assert ent.requires_grad is with_entropy_grad
        if not with_entropy_grad:
            assert ent.grad_fn is None
    else:
        assert ent is None

    loss = (w1.float() * lp.reshape(-1)).sum()
    if with_entropy and ent.requires_grad:
        loss = loss + (w2.float() * ent).sum()
    loss.backward()
    assert logits.grad is not None and logits.grad.dtype == dtype
    gatol = 2 * atol + (2.0**-8 * e_grad.abs() if dtype == torch.bfloat16 else 0)
    err = (logits.grad.double() - e_grad).abs()
    assert bool((err <= gatol).all()), f"grad: max err {float(err.max()):.3e}"

    # inputs untouched, values and version counters
    assert torch.equal(logits.detach(), before) and logits._version == v_logits
    assert tokens._version == v_tokens
    if keep is not None:
        assert torch.equal(keep, keep_before) and keep._version == v_keep


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["none", "random"])
def test_neg_inf_entries(target, dtype, mask_kind):
    mod = TARGETS[target]
    T, V = 6, 29
    x = make_logits(T, V, 11, neg_inf=True)
    logits = x.to(dtype).requires_grad_(True)
    x64 = logits.detach().double()
    tokens = make_tokens(T, V, 11, x64)
    keep = make_mask(mask_kind, T, V, tokens, 11)
    w1 = torch.linspace(-1, 1, T, dtype=torch.float64)
    w2 = torch.linspace(0.5, -0.7, T, dtype=torch.float64)
    for chunk in (-1, 2):
        logits.grad = None
        lp, ent = mod.calculate_log_probs_and_entropy(
            logits, tokens, None, with_entropy=True, chunk_size=chunk, log_prob_keep_mask=keep)
        e_lp, e_ent, e_grad = oracle(x64, tokens, keep, True, True, w1, w2)
        atol = tol32(x64, V)
        close(lp.reshape(-1), e_lp, atol, "log_prob")
        close(ent, e_ent, atol, "entropy")
        ((w1.float() * lp.reshape(-1)).sum() + (w2.float() * ent).sum()).backward()
        g = logits.grad.double()
        assert not torch.isnan(g).any()
        gatol = 2 * atol + (2.0**-8 * e_grad.abs() if dtype == torch.bfloat16 else 0)
        assert bool(((g - e_grad).abs() <= gatol).all())
        assert bool((g[torch.isinf(x64)] == 0).all())


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("chunk", [-1, 4])
def test_empty_batch(target, with_entropy, chunk):
    mod = TARGETS[target]
    logits = torch.zeros(0, 13, requires_grad=True)
    tokens = torch.zeros(0, dtype=torch.long)
    keep = torch.zeros(0, 13, dtype=torch.bool)
    for mask in (None, keep):
        lp, ent = mod.calculate_log_probs_and_entropy(
            logits, tokens, None, with_entropy=with_entropy, chunk_size=chunk,
            log_prob_keep_mask=mask)
        assert lp.numel() == 0 and lp.dtype == torch.float32
        if with_entropy:
            assert ent.shape == (0,) and ent.dtype == torch.float32
        else:
            assert ent is None
        loss = lp.sum() + (ent.sum() if with_entropy and ent.requires_grad else 0)
        loss.backward()
        assert logits.grad is None or logits.grad.shape == logits.shape


@pytest.mark.parametrize("target", list(TARGETS))
def test_entropy_flags_and_no_grad(target):
    mod = TARGETS[target]
    x = make_logits(4, 9, 3)
    t = make_tokens(4, 9, 3)
    for req in (False, True):
        for weg in (False, True):
            logits = x.float().requires_grad_(req)
            lp, ent = mod.calculate_log_probs_and_entropy(
                logits, t, None, with_entropy=True, with_entropy_grad=weg)
            assert ent.requires_grad is (req and weg)
            assert lp.requires_grad is req
            lp2, ent2 = mod.calculate_log_probs_and_entropy(logits, t, None, with_entropy=False,
                                                            with_entropy_grad=weg)
            assert ent2 is None
    logits = x.float().requires_grad_(True)
    with torch.no_grad():
        lp, ent = mod.calculate_log_probs_and_entropy(logits, t, None, with_entropy=True)
    assert not lp.requires_grad and not ent.requires_grad


@pytest.mark.parametrize("target", list(TARGETS))
def test_float32_input_not_aliased_by_upcast(target):
    """`.float()` on float32 is a no-op: the routine must not edit the caller's logits."""
    mod = TARGETS[target]
    logits = make_logits(5, 17, 5, neg_inf=True).float()
    tokens = make_tokens(5, 17, 5, logits.double())
    keep = make_mask("drop_target", 5, 17, tokens, 5)
    before, v = logits.clone(), logits._version
    leaf = logits.clone().requires_grad_(True)
    lp, ent = mod.calculate_log_probs_and_entropy(leaf, tokens, None, with_entropy=True,
                                                  chunk_size=2, log_prob_keep_mask=keep)
    (lp.sum() + ent.sum()).backward()
    lp, ent = mod.calculate_log_probs_and_entropy(logits, tokens, None, with_entropy=True,
                                                  log_prob_keep_mask=keep)
    assert torch.equal(logits, before) and logits._version == v


def test_retain_graph_backward_twice_is_stable():
    logits = make_logits(5, 11, 8).float().requires_grad_(True)
    tokens = make_tokens(5, 11, 8)
    lp, ent = fused.calculate_log_probs_and_entropy(logits, tokens, None, with_entropy=True)
    loss = lp.sum() + 0.3 * ent.sum()
    loss.backward(retain_graph=True)
    g1 = logits.grad.clone()
    logits.grad = None
    loss.backward()
    assert torch.equal(g1, logits.grad)


def test_unused_output_gradient_is_materialized():
    """Backward through the entropy only still gets the log-prob side right (zero w1)."""
    x = make_logits(4, 10, 9)
    t = make_tokens(4, 10, 9)
    logits = x.float().requires_grad_(True)
    _lp, ent = fused.calculate_log_probs_and_entropy(logits, t, None, with_entropy=True)
    ent.sum().backward()
    _, _, e_grad = oracle(x, t, None, True, True, torch.zeros(4, dtype=torch.float64),
                          torch.ones(4, dtype=torch.float64))
    assert float((logits.grad.double() - e_grad).abs().max()) <= 2 * tol32(x, 10)


# ---------------------------------------------------------------------------- fused structure
class _Recorder(FusedLogProbEntropy):
    def __init__(self):
        self.stats = []

    def all_reduce(self, tensor, op, group, stat):
        self.stats.append(stat)
        return super().all_reduce(tensor, op, group, stat)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_collective_sequence(masked, with_entropy):
    r = _Recorder()
    T, V = 7, 8
    logits = make_logits(T, V, 1).float().requires_grad_(True)
    t = make_tokens(T, V, 1)
    keep = make_mask("random", T, V, t, 1) if masked else None
    r.calculate_log_probs_and_entropy(logits, t, None, with_entropy=with_entropy, chunk_size=3,
                                      log_prob_keep_mask=keep, with_entropy_grad=False)
    # Two collectives per chunk: one MAX of the stacked maxima, one SUM of the stacked sums.
    maxima = ["max"] + (["masked_max"] if masked else [])
    sums = ["sumexp", "target_logit"] + (["masked_sumexp"] if masked else [])
    sums += ["entropy_term"] if with_entropy else []
    per_chunk = ["+".join(maxima), "+".join(sums)]
    assert r.stats == per_chunk * 3
    # metric-only / no_grad issue the same sequence (slime #1822)
    r.stats = []
    with torch.no_grad():
        r.calculate_log_probs_and_entropy(logits, t, None, with_entropy=with_entropy,
                                          chunk_size=3, log_prob_keep_mask=keep)
    assert r.stats == per_chunk * 3
    r.stats = []
    r.calculate_log_probs_and_entropy(logits[:0], t[:0], None, with_entropy=with_entropy,
                                      chunk_size=3)
    assert r.stats == []


def test_module_functions_are_bound_to_default_instance():
    assert fused.calculate_log_probs_and_entropy.__self__ is fused.ROUTINE
    assert fused.get_log_probs_and_entropy.__self__ is fused.ROUTINE
    assert isinstance(fused.ROUTINE, FusedLogProbEntropy)
    assert isinstance(naive.ROUTINE, FusedLogProbEntropy)
    assert naive.get_log_probs_and_entropy.__self__ is naive.ROUTINE


def test_single_step_override_changes_the_routine():
    """A mutant overriding one step is picked up in forward and backward."""

    class NoEntropyGrad(FusedLogProbEntropy):
        def entropy_grad_term(self, p, log_p, entropy):
            return torch.zeros_like(p)

    class Bf16Grad(FusedLogProbEntropy):
        def cast_grad(self, grad, dtype):
            return grad.to(torch.bfloat16).to(dtype)

    x = make_logits(4, 10, 2)
    t = make_tokens(4, 10, 2)
    grads = []
    for r in (FusedLogProbEntropy(), NoEntropyGrad(), Bf16Grad()):
        logits = x.float().requires_grad_(True)
        lp, ent = r.calculate_log_probs_and_entropy(logits, t, None, with_entropy=True)
        (lp.sum() + 0.5 * ent.sum()).backward()
        grads.append(logits.grad)
    assert not torch.allclose(grads[0], grads[1])
    assert not torch.equal(grads[0], grads[2])


def test_ctx_holds_no_tensor_attributes():
    logits = make_logits(4, 10, 2).float().requires_grad_(True)
    t = make_tokens(4, 10, 2)
    lp, _ent = fused.calculate_log_probs_and_entropy(logits, t, None, with_entropy=True,
                                                     log_prob_keep_mask=torch.ones(4, 10).bool())
    attrs = vars(lp.grad_fn)
    assert attrs, "expected ctx attributes"
    assert not any(isinstance(v, torch.Tensor) for v in attrs.values())


# ---------------------------------------------------------------------------- memory
class _BigAllocs(TorchDispatchMode):
    """Counts ops that allocate a new tensor of more than ``limit`` elements."""

    def __init__(self, limit):
        super().__init__()
        self.limit, self.ops = limit, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {a.untyped_storage().data_ptr()
               for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for o in pytree.tree_leaves(out):
            if (isinstance(o, torch.Tensor) and o.numel() > self.limit
                    and o.untyped_storage().data_ptr() not in ins):
                self.ops.append(str(func))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_chunk_size_is_honoured(dtype, masked):
    """With chunk_size c, no [T, V_local] temporaries: only the q buffer (forward) and the
    gradient (backward) exceed c * V_local elements (NeMo-RL #2871)."""
    T, V, c = 16, 32, 2
    logits = make_logits(T, V, 6).to(dtype).requires_grad_(True)
    t = make_tokens(T, V, 6)
    keep = make_mask("random", T, V, t, 6) if masked else None
    with _BigAllocs(c * V) as rec:
        lp, ent = fused.calculate_log_probs_and_entropy(
            logits, t, None, with_entropy=True, chunk_size=c, log_prob_keep_mask=keep)
    assert len(rec.ops) <= 1, rec.ops
    loss = lp.sum() + 0.5 * ent.sum()
    with _BigAllocs(c * V) as rec:
        loss.backward()
    assert len(rec.ops) <= 2, rec.ops  # the gradient, and autograd's accumulation into .grad


def saved_bytes(fn, logits):
    """Unique storages saved for backward (via saved_tensors_hooks), the caller's logits excluded."""
    seen = {}
    caller = logits.untyped_storage().data_ptr()

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() != caller:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


MEM_FIGURES = {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("mode", ["logprob", "metric", "entgrad"])
def test_saved_bytes_budget(dtype, masked, mode):
    T, V = 64, 512
    unit = T * V * 4
    logits = make_logits(T, V, 4).to(dtype).requires_grad_(True)
    t = make_tokens(T, V, 4)
    keep = make_mask("random", T, V, t, 4) if masked else None
    kw = dict(with_entropy=mode != "logprob", with_entropy_grad=mode == "entgrad",
              log_prob_keep_mask=keep, chunk_size=16)
    nbytes, (lp, ent) = saved_bytes(
        lambda: fused.calculate_log_probs_and_entropy(logits, t, None, **kw), logits)
    MEM_FIGURES[(str(dtype), masked, mode)] = nbytes / unit
    print(f"saved {dtype} masked={masked} {mode}: {nbytes / unit:.4f} x T*V_local*4 "
          f"({nbytes} B)")
    assert nbytes <= unit + 64 * T + 1024
    # the gradient still flows
    loss = lp.sum() + (ent.sum() if ent is not None and ent.requires_grad else 0)
    loss.backward()
    assert logits.grad.dtype == dtype


def test_saves_nothing_without_grad():
    logits = make_logits(16, 64, 4).float()
    t = make_tokens(16, 64, 4)
    for req, ctx in ((False, torch.enable_grad()), (True, torch.no_grad())):
        lg = logits.clone().requires_grad_(req)
        with ctx:
            nbytes, _ = saved_bytes(lambda lg=lg: fused.calculate_log_probs_and_entropy(
                lg, t, None, with_entropy=True), lg)
        assert nbytes == 0


# ---------------------------------------------------------------------------- Level 2 wrapper
def packed_batch(seed=0, V=23):
    g = torch.Generator().manual_seed(seed)
    total = [5, 3, 6, 2]
    resp = [2, 1, 4, 0]
    toks = [torch.randint(0, V, (L,), generator=g) for L in total]
    T = sum(total)
    logits = (torch.randn(1, T, V, generator=g) * 3).requires_grad_(True)
    return logits, toks, total, resp


def expected_wrapper(logits, toks, total, resp, temp, top_ids=None, top_offs=None):
    x = logits.detach().double().squeeze(0) / temp
    lps, ents = [], []
    o = 0
    for i, (L, R) in enumerate(zip(total, resp, strict=True)):
        lp_i, ent_i = [], []
        for r in range(R):
            row = o + L - R - 1 + r
            target = int(toks[i][L - R + r])
            xr = x[row].clone()
            if top_ids is not None and r + 1 < len(top_offs[i]):  # a recorded nucleus, maybe empty
                a, b = int(top_offs[i][r]), int(top_offs[i][r + 1])
                keep = torch.zeros_like(xr, dtype=torch.bool)
                keep[torch.as_tensor(top_ids[i][a:b], dtype=torch.long)] = True
                keep[target] = True
                xr = xr.masked_fill(~keep, float("-inf"))
            lp_i.append(torch.log_softmax(xr, -1)[target])
            p = torch.softmax(x[row], -1)
            ent_i.append(-(p * torch.log(p)).sum())
        lps.append(torch.stack(lp_i) if lp_i else torch.zeros(0, dtype=torch.float64))
        ents.append(torch.stack(ent_i) if ent_i else torch.zeros(0, dtype=torch.float64))
        o += L
    return lps, ents


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("temp", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [-1, 4])
@pytest.mark.parametrize("top_p", [False, True])
def test_wrapper_shift_and_extraction(target, temp, chunk, top_p):
    mod = TARGETS[target]
    logits, toks, total, resp = packed_batch()
    V = logits.shape[-1]
    before, v = logits.detach().clone(), logits._version
    args = SimpleNamespace(entropy_coef=0.01, log_probs_chunk_size=chunk,
                           rollout_temperature=temp, allgather_cp=False)
    top_ids = top_offs = None
    if top_p:
        # sample 0: two nuclei (the second empty: only the target kept); sample 1: none recorded
        # (offsets [0]); sample 2: four nuclei, one without the target, as int32 tensors;
        # sample 3: no response
        top_ids = [[3, 7, 1], [], torch.tensor([0, 1, 2, 5, 9, 11, 4, 22], dtype=torch.int32), []]
        top_offs = [[0, 3, 3], [0], torch.tensor([0, 2, 5, 7, 8], dtype=torch.int32), [0]]
    _, res = mod.get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=toks, total_lengths=total, response_lengths=resp,
        with_entropy=True, top_p_token_ids=top_ids, top_p_token_offsets=top_offs)
    e_lps, e_ents = expected_wrapper(logits, toks, total, resp, temp, top_ids, top_offs)
    atol = tol32(logits.detach().double() / temp, V)
    assert len(res["log_probs"]) == len(total) and len(res["entropy"]) == len(total)
    for i, R in enumerate(resp):
        assert res["log_probs"][i].shape == (R,)
        assert res["entropy"][i].shape == (R,)
        close(res["log_probs"][i], e_lps[i], atol, f"log_probs[{i}]")
        close(res["entropy"][i], e_ents[i], atol, f"entropy[{i}]")
    sum(x.sum() for x in res["log_probs"]).backward()
    assert logits.grad.shape == logits.shape
    assert torch.equal(logits.detach(), before) and logits._version == v


@pytest.mark.parametrize("target", list(TARGETS))
def test_wrapper_returns_empty_tensor_and_no_entropy_key(target):
    mod = TARGETS[target]
    logits, toks, total, resp = packed_batch(1)
    out, res = mod.get_log_probs_and_entropy(
        logits, args=SimpleNamespace(), unconcat_tokens=toks, total_lengths=total,
        response_lengths=resp)
    assert out.numel() == 0 and out.device == logits.device
    assert "entropy" not in res and len(res["log_probs"]) == len(total)


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("coef,expect", [("absent", False), (0.0, False), (-0.0, False),
                                          (-0.01, True), (0.01, True)])
def test_wrapper_entropy_grad_rule(target, coef, expect):
    """slime PR #2153: with_entropy_grad = with_entropy and entropy_coef != 0."""
    mod = TARGETS[target]
    logits, toks, total, resp = packed_batch(2)
    args = SimpleNamespace(log_probs_chunk_size=-1, allgather_cp=False)
    if coef != "absent":
        args.entropy_coef = coef
    _, res = mod.get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=toks, total_lengths=total, response_lengths=resp,
        with_entropy=True)
    for i, R in enumerate(resp):
        if R:
            assert res["entropy"][i].requires_grad is expect
            assert res["log_probs"][i].requires_grad


@pytest.mark.parametrize("chunk", [2, 3])
def test_wrapper_passes_chunk_size(chunk):
    """args.log_probs_chunk_size reaches the kernel (NeMo-RL #2871: ignored on the train path)."""
    logits, toks, total, resp = packed_batch(3)
    V = logits.shape[-1]
    args = SimpleNamespace(entropy_coef=0.01, log_probs_chunk_size=chunk, allgather_cp=False)
    with _BigAllocs(chunk * V) as rec:
        _, res = fused.get_log_probs_and_entropy(
            logits, args=args, unconcat_tokens=toks, total_lengths=total,
            response_lengths=resp, with_entropy=True)
    assert len(rec.ops) <= 1, rec.ops  # only the q buffer


def test_wrapper_empty_batch():
    for mod in TARGETS.values():
        logits = torch.zeros(1, 0, 7, requires_grad=True)
        _, res = mod.get_log_probs_and_entropy(
            logits, args=SimpleNamespace(entropy_coef=0.1), unconcat_tokens=[],
            total_lengths=[], response_lengths=[], with_entropy=True)
        assert res == {"log_probs": [], "entropy": []}


def test_wrapper_tp_group_without_parallel_state():
    """With megatron imported but parallel_state not initialised, the group is None."""
    pytest.importorskip("megatron.core")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state  # noqa: F401
    assert fused.ROUTINE.tp_group() is None


def test_top_p_keep_mask_local_shard():
    """The local shard of the mask is taken with shard_start (rank 1 of 3, V_local = 5)."""
    r = fused.get_log_probs_and_entropy.__self__
    mask = r.top_p_keep_mask(4, 5, 1, [4], [2], [[1, 6, 9, 12, 2]], [[0, 4, 5]], "cpu")
    # rows 1, 2 predict the response; row 1 keeps global {1, 6, 9, 12} -> local {1, 4};
    # row 2 keeps {2}, on another shard
    expect = torch.ones(4, 5, dtype=torch.bool)
    expect[1] = False
    expect[1, [1, 4]] = True
    expect[2] = False
    assert torch.equal(mask, expect)
    assert r.top_p_keep_mask(4, 5, 0, [4], [2], None, None, "cpu") is None
    # An empty recorded range masks the whole row; a short offsets list leaves the tail unmasked.
    empty = r.top_p_keep_mask(4, 5, 1, [4], [2], [[7]], [[0, 0, 1]], "cpu")
    assert not empty[1].any() and empty[2].tolist() == [False, False, True, False, False]
    short = r.top_p_keep_mask(4, 5, 1, [4], [2], [torch.tensor([7], dtype=torch.int32)], [[0, 1]], "cpu")
    assert short[1].tolist() == [False, False, True, False, False] and short[2].all()
