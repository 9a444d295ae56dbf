"""The float64 oracle against independent routes: torch.log_softmax + autograd, gradcheck, and
hand-computed values."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import reference as ref

F64 = torch.float64
NEG_INF = float("-inf")
FAST = settings(max_examples=40, deadline=None, derandomize=True)


# ---------------------------------------------------------------- independent routes


def _autograd_kernel(x, tokens, keep, w1, w2):
    """Values and gradient of sum(w1*lp) + sum(w2*H) via torch ops and autograd."""
    z = x.detach().to(F64).clone().requires_grad_(True)
    rows = torch.arange(z.shape[0])
    if keep is not None:
        keep = keep.clone()
        keep[rows, tokens] = True
        zm = torch.where(keep, z, torch.full_like(z, NEG_INF))
    else:
        zm = z
    lp = torch.log_softmax(zm, dim=-1)[rows, tokens]
    ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    loss = z.new_zeros(())
    if w1 is not None:
        loss = loss + (w1 * lp).sum()
    if w2 is not None:
        loss = loss + (w2 * ent).sum()
    (g,) = torch.autograd.grad(loss, z, allow_unused=True) if loss.requires_grad else (torch.zeros_like(z),)
    return lp.detach(), ent.detach(), g


class _OracleLoss(torch.autograd.Function):
    """Oracle forward with the oracle's analytic gradient as backward, for gradcheck."""

    @staticmethod
    def forward(ctx, x, tokens, keep, w1, w2):
        ctx.save_for_backward(x, tokens, keep, w1, w2)
        return (w1 * ref.log_probs(x, tokens, keep)).sum() + (w2 * ref.entropy(x)).sum()

    @staticmethod
    def backward(ctx, g):
        x, tokens, keep, w1, w2 = ctx.saved_tensors
        return g * ref.logits_grad(x, tokens, keep, w1, w2), None, None, None, None


def _random_case(seed, T, V, scale=3.0, masked=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, V, generator=gen, dtype=F64) * scale
    tokens = torch.randint(0, V, (T,), generator=gen)
    keep = (torch.rand(T, V, generator=gen) < 0.5) if masked else None
    w1 = torch.randn(T, generator=gen, dtype=F64)
    w2 = torch.randn(T, generator=gen, dtype=F64)
    return x, tokens, keep, w1, w2


def _close(a, b, tol=1e-12):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# ---------------------------------------------------------------- kernel


@FAST
@given(
    T=st.integers(0, 5),
    V=st.integers(1, 9),
    seed=st.integers(0, 2**31 - 1),
    masked=st.booleans(),
    use_w1=st.booleans(),
    use_w2=st.booleans(),
    scale=st.sampled_from([0.1, 3.0, 40.0]),
)
def test_kernel_matches_autograd(T, V, seed, masked, use_w1, use_w2, scale):
    x, tokens, keep, w1, w2 = _random_case(seed, T, V, scale, masked)
    w1 = w1 if use_w1 else None
    w2 = w2 if use_w2 else None
    lp_ref, ent_ref, g_ref = _autograd_kernel(x, tokens, keep, w1, w2)
    lp, ent, g = ref.log_probs(x, tokens, keep), ref.entropy(x), ref.logits_grad(x, tokens, keep, w1, w2)
    assert lp.dtype == ent.dtype == g.dtype == F64
    assert lp.shape == (T,) and ent.shape == (T,) and g.shape == (T, V)
    _close(lp, lp_ref, 1e-12 * scale)
    _close(ent, ent_ref, 1e-12 * scale)
    _close(g, g_ref)


@pytest.mark.parametrize("masked", [False, True])
def test_gradcheck_analytic_gradient(masked):
    x, tokens, keep, w1, w2 = _random_case(7, 4, 6, masked=masked)
    if keep is None:
        keep = torch.ones(4, 6, dtype=torch.bool)
    x.requires_grad_(True)
    loss = lambda z: _OracleLoss.apply(z, tokens, keep, w1, w2)  # noqa: E731
    assert torch.autograd.gradcheck(loss, (x,), eps=1e-6, atol=1e-7)


def test_empty_rows():
    x = torch.zeros(0, 5)
    tokens = torch.zeros(0, dtype=torch.int64)
    keep = torch.zeros(0, 5, dtype=torch.bool)
    w = torch.zeros(0)
    assert ref.log_probs(x, tokens, keep).shape == (0,)
    assert ref.log_probs(x, tokens).dtype == F64
    assert ref.entropy(x).shape == (0,)
    assert ref.effective_keep_mask(keep, tokens).shape == (0, 5)
    g = ref.logits_grad(x, tokens, keep, w, w)
    assert g.shape == (0, 5) and g.dtype == F64


def test_single_row_hand_values():
    p = [1 / 6, 2 / 6, 3 / 6]
    x = torch.tensor([[math.log(1), math.log(2), math.log(3)]], dtype=F64) + 5.0
    tokens = torch.tensor([1])
    _close(ref.log_probs(x, tokens), torch.tensor([math.log(2 / 6)], dtype=F64))
    h = -sum(q * math.log(q) for q in p)
    _close(ref.entropy(x), torch.tensor([h], dtype=F64))
    g = ref.logits_grad(x, tokens, None, torch.tensor([2.0]), None)
    _close(g, torch.tensor([[-2 * p[0], 2 * (1 - p[1]), -2 * p[2]]], dtype=F64))
    g = ref.logits_grad(x, tokens, None, None, torch.tensor([1.0]))
    _close(g, torch.tensor([[-q * (math.log(q) + h) for q in p]], dtype=F64))
    # Keep {0, 2}, target 1 forced in: softmax over {0, 1, 2} is unchanged.
    keep = torch.tensor([[True, False, True]])
    _close(ref.log_probs(x, tokens, keep), torch.tensor([math.log(2 / 6)], dtype=F64))
    # Keep {1, 2}: log(2 / 5).
    keep = torch.tensor([[False, True, True]])
    _close(ref.log_probs(x, torch.tensor([2]), keep), torch.tensor([math.log(3 / 5)], dtype=F64))


def test_effective_keep_mask_forces_target_and_copies():
    keep = torch.tensor([[False, False, True], [True, False, False]])
    before = keep.clone()
    out = ref.effective_keep_mask(keep, torch.tensor([0, 1]))
    assert torch.equal(out, torch.tensor([[True, False, True], [True, True, False]]))
    assert torch.equal(keep, before) and out.data_ptr() != keep.data_ptr()
    assert ref.effective_keep_mask(None, torch.tensor([0])) is None


def test_mask_dropping_everything_keeps_only_target():
    x, tokens, _, w1, w2 = _random_case(3, 5, 7)
    none_kept = torch.zeros(5, 7, dtype=torch.bool)
    only_target = torch.nn.functional.one_hot(tokens, 7).bool()
    for keep in (none_kept, only_target):
        assert torch.equal(ref.log_probs(x, tokens, keep), torch.zeros(5, dtype=F64))
        assert torch.equal(ref.logits_grad(x, tokens, keep, w1, None), torch.zeros(5, 7, dtype=F64))
    # The entropy and its gradient ignore the mask.
    _close(ref.logits_grad(x, tokens, none_kept, None, w2), ref.logits_grad(x, tokens, None, None, w2))
    # A mask that drops only the target changes nothing.
    all_but_target = ~only_target
    _close(ref.log_probs(x, tokens, all_but_target), ref.log_probs(x, tokens))


def test_neg_inf_entries():
    gen = torch.Generator().manual_seed(11)
    T, V = 6, 8
    x = torch.randn(T, V, generator=gen, dtype=F64)
    tokens = torch.randint(0, V, (T,), generator=gen)
    dead = torch.rand(T, V, generator=gen) < 0.4
    dead[torch.arange(T), tokens] = False
    dead[0] = False
    dead[0, 3:] = True  # a row with many dead entries
    dead[0, tokens[0]] = False
    x = x.masked_fill(dead, NEG_INF)
    w1 = torch.randn(T, generator=gen, dtype=F64)
    w2 = torch.randn(T, generator=gen, dtype=F64)
    lp, ent, g = ref.log_probs(x, tokens), ref.entropy(x), ref.logits_grad(x, tokens, None, w1, w2)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(g).all()
    assert torch.equal(g[dead], torch.zeros(int(dead.sum()), dtype=F64))
    # Independent route per row: the same loss on the finite entries only.
    for t in range(T):
        alive = ~dead[t]
        y = int(alive[: tokens[t]].sum())
        z = x[t, alive].clone().requires_grad_(True)
        lz = torch.log_softmax(z, -1)
        lp_t, ent_t = lz[y], -(lz.exp() * lz).sum()
        (gz,) = torch.autograd.grad(w1[t] * lp_t + w2[t] * ent_t, z)
        _close(lp[t], lp_t.detach())
        _close(ent[t], ent_t.detach())
        _close(g[t, alive], gz)


def test_huge_logits():
    V = 50
    x = torch.zeros(3, V, dtype=F64)
    x[:, 4] = 1e4
    tokens = torch.tensor([4, 0, 9])
    ent = ref.entropy(x)
    assert torch.isfinite(ent).all() and ent.abs().max() < 1e-300
    _close(ref.log_probs(x, tokens), torch.tensor([0.0, -1e4, -1e4], dtype=F64))
    g = ref.logits_grad(x, tokens, None, torch.ones(3, dtype=F64), torch.ones(3, dtype=F64))
    assert torch.isfinite(g).all()
    expected = -torch.nn.functional.one_hot(torch.full((3,), 4), V).to(F64)
    expected[torch.arange(3), tokens] += 1.0
    _close(g, expected)
    # Shift invariance with all entries near 1e4: float64 keeps ~1e-12 of the offset.
    y = torch.randn(4, V, generator=torch.Generator().manual_seed(2), dtype=F64)
    t = torch.arange(4)
    _close(ref.entropy(y + 1e4), ref.entropy(y), 1e-9)
    _close(ref.log_probs(y + 1e4, t), ref.log_probs(y, t), 1e-9)
    w = torch.ones(4, dtype=F64)
    _close(ref.logits_grad(y + 1e4, t, None, None, w), ref.logits_grad(y, t, None, None, w), 1e-9)


def test_ties():
    V = 8
    x = torch.full((2, V), 3.25)
    tokens = torch.tensor([0, 5])
    _close(ref.entropy(x), torch.full((2,), math.log(V), dtype=F64))
    _close(ref.log_probs(x, tokens), torch.full((2,), -math.log(V), dtype=F64))
    keep = torch.zeros(2, V, dtype=torch.bool)
    keep[:, :3] = True  # row 1 also keeps its target 5: 4 entries
    _close(ref.log_probs(x, tokens, keep), torch.tensor([-math.log(3), -math.log(4)], dtype=F64))
    # Uniform is the entropy maximum: zero gradient.
    _close(ref.logits_grad(x, tokens, None, None, torch.ones(2)), torch.zeros(2, V, dtype=F64))
    g = ref.logits_grad(x, tokens, None, torch.ones(2), None)
    expected = torch.full((2, V), -1 / V, dtype=F64)
    expected[torch.arange(2), tokens] += 1
    _close(g, expected)


def test_low_precision_inputs_are_upcast_and_untouched():
    x64, tokens, keep, w1, w2 = _random_case(5, 3, 6)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = x64.to(dtype)
        before = x.clone()
        exact = x.to(F64)
        _close(ref.log_probs(x, tokens, keep), ref.log_probs(exact, tokens, keep), 0)
        _close(ref.entropy(x), ref.entropy(exact), 0)
        g = ref.logits_grad(x, tokens, keep, w1.to(dtype), w2.to(dtype))
        assert g.dtype == F64
        _close(g, ref.logits_grad(exact, tokens, keep, w1.to(dtype).to(F64), w2.to(dtype).to(F64)), 0)
        assert torch.equal(x, before)


# ---------------------------------------------------------------- wrapper


def test_entropy_grad_rule():
    ns = SimpleNamespace
    assert ref.entropy_grad_rule(True, ns()) is False
    assert ref.entropy_grad_rule(True, ns(entropy_coef=0.0)) is False
    assert ref.entropy_grad_rule(True, ns(entropy_coef=-0.0)) is False
    assert ref.entropy_grad_rule(True, ns(entropy_coef=1e-8)) is True
    assert ref.entropy_grad_rule(True, ns(entropy_coef=-0.01)) is True
    assert ref.entropy_grad_rule(True, ns(entropy_coef=5.0)) is True
    assert ref.entropy_grad_rule(False, ns(entropy_coef=5.0)) is False


def test_apply_temperature():
    x = torch.tensor([[1.0, -2.0, 4.0]])
    assert torch.equal(ref.apply_temperature(x, None), x.to(F64))
    assert torch.equal(ref.apply_temperature(x, 0.5), torch.tensor([[2.0, -4.0, 8.0]], dtype=F64))
    assert ref.apply_temperature(x, 2.0).dtype == F64


# Packed: A at 0 (L=4, R=2), B at 4 (L=3, R=1), C at 7 (L=2, R=0), D at 9 (L=3, R=2).
PACK_TOKENS = [
    torch.tensor([10, 11, 12, 13]),
    torch.tensor([20, 21, 22]),
    torch.tensor([30, 31]),
    torch.tensor([40, 41, 42]),
]
PACK_TOTAL = [4, 3, 2, 3]
PACK_RESP = [2, 1, 0, 2]


def test_shift_and_response_rows_hand_example():
    targets = ref.shifted_targets(PACK_TOKENS, PACK_TOTAL)
    assert targets.dtype == torch.int64
    assert targets.tolist() == [11, 12, 13, 0, 21, 22, 0, 31, 0, 41, 42, 0]
    rows = ref.response_rows(PACK_TOTAL, PACK_RESP)
    assert [r.tolist() for r in rows] == [[1, 2], [5], [], [9, 10]]
    assert all(r.dtype == torch.int64 for r in rows)
    # The response rows predict exactly the last R tokens of each sample.
    assert [targets[r].tolist() for r in rows] == [[12, 13], [22], [], [41, 42]]
    with pytest.raises(ValueError):
        ref.response_rows([3], [3])
    assert ref.shifted_targets([], []).shape == (0,)


def test_top_p_keep_mask_hand_example():
    """slime's encoding: an empty range keeps nothing (the kernel restores the target); rows the
    offsets do not reach stay unmasked; tensors and lists are the same payload."""
    V = 6
    ids = [torch.tensor([1, 4, 2]), [3, 5], [], torch.tensor([0], dtype=torch.int32)]
    # A: row 1 keeps {1, 4}, row 2 keeps nothing (empty range). B: row 5 keeps {3, 5}.
    # C: no response. D: row 9 keeps {0}; row 10 has no recorded nucleus (offsets end).
    offsets = [torch.tensor([0, 2, 2]), [0, 2], [0], [0, 1]]
    mask = ref.top_p_keep_mask(12, V, PACK_TOTAL, PACK_RESP, ids, offsets)
    expected = torch.ones(12, V, dtype=torch.bool)
    expected[1] = torch.tensor([False, True, False, False, True, False])
    expected[2] = False
    expected[5] = torch.tensor([False, False, False, True, False, True])
    expected[9] = torch.tensor([True, False, False, False, False, False])
    assert torch.equal(mask, expected)
    # No offsets at all for a sample: none of its rows is masked.
    expected[9] = True
    assert torch.equal(ref.top_p_keep_mask(12, V, PACK_TOTAL, PACK_RESP, ids, [*offsets[:3], []]), expected)
    assert ref.top_p_keep_mask(12, V, PACK_TOTAL, PACK_RESP, None, None) is None
    with pytest.raises(ValueError, match="not part of the interface"):
        ref.top_p_keep_mask(12, V, PACK_TOTAL, PACK_RESP, [*ids[:3], None], offsets)


def test_empty_nucleus_log_prob_is_exactly_zero():
    z = torch.randn(12, 6, dtype=torch.float64)
    tokens = [torch.randint(0, 6, (n,)) for n in PACK_TOTAL]
    out = ref.wrapper_outputs(z, SimpleNamespace(), tokens, PACK_TOTAL, PACK_RESP, False,
                              [[1], [], [], [2, 3]], [[0, 1, 1], [0, 0], [0], [0, 0, 2]])
    assert out["log_probs"][0][1] == 0 and out["log_probs"][1][0] == 0 and out["log_probs"][3][0] == 0


def _naive_wrapper(z, args, tokens_list, total, resp, with_entropy, w_lp, w_ent, ids, offsets):
    """Row-by-row wrapper semantics written from the response tokens' point of view, with autograd."""
    z = z.detach().to(F64).clone().requires_grad_(True)
    tau = getattr(args, "rollout_temperature", 1.0)
    coef = getattr(args, "entropy_coef", 0.0)
    lps, ents, loss, start = [], [], z.new_zeros(()), 0
    for i, (toks, L, R) in enumerate(zip(tokens_list, total, resp, strict=True)):
        lp_i, ent_i = [], []
        for k in range(R):
            pos = L - R + k  # index of the response token in the sample
            row = z[start + pos - 1] / tau  # predicted by the previous position
            target = int(toks[pos])
            masked = row
            if ids is not None and k + 1 < len(offsets[i]):  # a recorded nucleus, maybe empty
                a, b = int(offsets[i][k]), int(offsets[i][k + 1])
                kept = {int(v) for v in ids[i][a:b]} | {target}
                drop = torch.tensor([v not in kept for v in range(row.numel())])
                masked = row.masked_fill(drop, NEG_INF)
            lp = torch.log_softmax(masked, -1)[target]
            ls = torch.log_softmax(row, -1)
            ent = -(ls.exp() * ls).sum()
            loss = loss + w_lp[i][k] * lp
            if with_entropy and coef != 0 and w_ent is not None:
                loss = loss + w_ent[i][k] * ent
            lp_i.append(lp.detach())
            ent_i.append(ent.detach())
        lps.append(torch.stack(lp_i) if lp_i else torch.zeros(0, dtype=F64))
        ents.append(torch.stack(ent_i) if ent_i else torch.zeros(0, dtype=F64))
        start += L
    g = torch.autograd.grad(loss, z)[0] if loss.requires_grad else torch.zeros_like(z)
    return lps, ents, g


PACK_IDS = [torch.tensor([1, 4, 2]), [3, 5], [], torch.tensor([0, 2, 5], dtype=torch.int32)]
PACK_OFFSETS = [torch.tensor([0, 2, 2]), [0, 2], [0], [0, 1]]  # an empty nucleus; a row without one


@pytest.mark.parametrize("top_p", [False, True])
@pytest.mark.parametrize("temperature", [None, 0.7])
@pytest.mark.parametrize("with_entropy,coef", [(False, 1.0), (True, 0.0), (True, -0.01), (True, 0.3)])
def test_wrapper_matches_naive(top_p, temperature, with_entropy, coef):
    gen = torch.Generator().manual_seed(123)
    V = 6
    tokens = [t % V for t in PACK_TOKENS]
    z = torch.randn(12, V, generator=gen) * 2
    args = SimpleNamespace(entropy_coef=coef, log_probs_chunk_size=-1)
    if temperature is not None:
        args.rollout_temperature = temperature
    w_lp = [torch.randn(r, generator=gen, dtype=F64) for r in PACK_RESP]
    w_ent = [torch.randn(r, generator=gen, dtype=F64) for r in PACK_RESP]
    ids, offsets = (PACK_IDS, PACK_OFFSETS) if top_p else (None, None)
    z_before = z.clone()
    out = ref.wrapper_outputs(z, args, tokens, PACK_TOTAL, PACK_RESP, with_entropy, ids, offsets)
    batch = (tokens, PACK_TOTAL, PACK_RESP, with_entropy)
    g = ref.wrapper_logits_grad(z, args, *batch, w_lp, w_ent, ids, offsets)
    lps, ents, g_ref = _naive_wrapper(z, args, *batch, w_lp, w_ent, ids, offsets)
    assert torch.equal(z, z_before)
    assert out["entropy_requires_grad"] is (with_entropy and coef != 0)
    assert [t.shape[0] for t in out["log_probs"]] == PACK_RESP
    for a, b in zip(out["log_probs"], lps, strict=True):
        assert a.dtype == F64
        _close(a, b)
    if with_entropy:
        for a, b in zip(out["entropy"], ents, strict=True):
            _close(a, b)
    else:
        assert out["entropy"] is None
    assert g.shape == (12, V) and g.dtype == F64
    _close(g, g_ref)
    # Rows outside responses carry no gradient.
    outside = torch.ones(12, dtype=torch.bool)
    outside[[1, 2, 5, 9, 10]] = False
    assert torch.equal(g[outside], torch.zeros(int(outside.sum()), V, dtype=F64))


def test_wrapper_entropy_term_follows_rule_and_top_p_is_log_prob_only():
    gen = torch.Generator().manual_seed(9)
    V = 6
    tokens = [t % V for t in PACK_TOKENS]
    z = torch.randn(12, V, generator=gen, dtype=F64)
    w_lp = [torch.zeros(r, dtype=F64) for r in PACK_RESP]
    w_ent = [torch.ones(r, dtype=F64) for r in PACK_RESP]
    call = lambda coef, we: ref.wrapper_logits_grad(  # noqa: E731
        z, SimpleNamespace(entropy_coef=coef), tokens, PACK_TOTAL, PACK_RESP, True, w_lp, we
    )
    assert torch.equal(call(0.0, w_ent), torch.zeros(12, V, dtype=F64))
    assert call(-0.5, w_ent).abs().sum() > 1e-3
    assert torch.equal(call(-0.5, None), torch.zeros(12, V, dtype=F64))
    args = SimpleNamespace()
    plain = ref.wrapper_outputs(z, args, tokens, PACK_TOTAL, PACK_RESP, True)
    top_p = ref.wrapper_outputs(z, args, tokens, PACK_TOTAL, PACK_RESP, True, PACK_IDS, PACK_OFFSETS)
    assert plain["entropy_requires_grad"] is False
    for a, b in zip(plain["entropy"], top_p["entropy"], strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(plain["log_probs"][0], top_p["log_probs"][0])


def test_wrapper_temperature_chain_rule_by_gradcheck():
    gen = torch.Generator().manual_seed(4)
    V = 6
    tokens = [t % V for t in PACK_TOKENS]
    args = SimpleNamespace(entropy_coef=0.2, rollout_temperature=0.6)
    w_lp = [torch.randn(r, generator=gen, dtype=F64) for r in PACK_RESP]
    w_ent = [torch.randn(r, generator=gen, dtype=F64) for r in PACK_RESP]

    class Loss(torch.autograd.Function):
        @staticmethod
        def forward(ctx, z):
            ctx.save_for_backward(z)
            out = ref.wrapper_outputs(z, args, tokens, PACK_TOTAL, PACK_RESP, True, PACK_IDS, PACK_OFFSETS)
            lp = sum((w * v).sum() for w, v in zip(w_lp, out["log_probs"], strict=True))
            return lp + sum((w * v).sum() for w, v in zip(w_ent, out["entropy"], strict=True))

        @staticmethod
        def backward(ctx, g):
            (z,) = ctx.saved_tensors
            return g * ref.wrapper_logits_grad(
                z, args, tokens, PACK_TOTAL, PACK_RESP, True, w_lp, w_ent, PACK_IDS, PACK_OFFSETS
            )

    z = torch.randn(12, V, generator=gen, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(Loss.apply, (z,), eps=1e-6, atol=1e-7)


def test_wrapper_empty_batch():
    z = torch.zeros(0, 4)
    out = ref.wrapper_outputs(z, SimpleNamespace(entropy_coef=1.0), [], [], [], True)
    assert out["log_probs"] == [] and out["entropy"] == [] and out["entropy_requires_grad"] is True
    g = ref.wrapper_logits_grad(z, SimpleNamespace(entropy_coef=1.0), [], [], [], True, [], [])
    assert g.shape == (0, 4) and g.dtype == F64
