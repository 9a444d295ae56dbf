"""The no-false-finding controls (tests/controls) against a float64 computation, single process.

No harness engine and no torch.distributed: tp_group=None is a single rank. Values and gradients
for float32 and bfloat16 logits, with and without a keep mask, chunked and not, -inf entries,
T == 0, the metric-only flags, input integrity, and the shared wrapper's slime top-p encoding.
"""
from __future__ import annotations

import importlib
import math
from types import SimpleNamespace

import pytest
import torch

CONTROLS = ("unshifted", "online", "gather", "twopass_pairwise", "inplace_grad", "autograd_collective")
T, V = 7, 13


def _control(name: str):
    return importlib.import_module(f"tests.controls.{name}")


def _inputs(dtype: torch.dtype, masked: bool, neginf: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, V, generator=g, dtype=torch.float64) * 3
    tokens = torch.randint(0, V, (T,), generator=g)
    if neginf:
        x = x.masked_fill(torch.rand(T, V, generator=g) < 0.4, -math.inf)
        x[torch.arange(T), tokens] = torch.randn(T, generator=g, dtype=torch.float64)
        x[0] = -math.inf  # a row where everything but the target is -inf
        x[0, tokens[0]] = 1.5
    keep = (torch.rand(T, V, generator=g) < 0.5) if masked else None
    return x.to(dtype), tokens, keep, torch.randn(T, generator=g), torch.randn(T, generator=g)


def _oracle(x: torch.Tensor, tokens, keep, w1, w2, entropy_grad: bool):
    x64 = x.to(torch.float64).requires_grad_()
    lp_in = x64
    if keep is not None:
        k = keep.clone()
        k[torch.arange(T), tokens] = True
        lp_in = x64.masked_fill(~k, -math.inf)
    lp = torch.log_softmax(lp_in, -1)[torch.arange(T), tokens]
    log_p = torch.log_softmax(x64, -1)
    p = log_p.exp()
    ent = -(p * torch.where(p > 0, log_p, torch.zeros_like(log_p))).sum(-1)
    loss = (w1.double() * lp).sum() + ((w2.double() * ent).sum() if entropy_grad else 0)
    (grad,) = torch.autograd.grad(loss, x64)
    return lp.detach(), ent.detach(), grad


@pytest.mark.parametrize("name", CONTROLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_matches_float64(name, dtype, masked, entropy_grad):
    kernel = _control(name).calculate_log_probs_and_entropy
    for neginf, chunk_size in ((False, -1), (True, -1), (False, 3), (True, 3)):
        x, tokens, keep, w1, w2 = _inputs(dtype, masked, neginf)
        before = (x.clone(), x._version, None if keep is None else keep.clone())
        leaf = x.clone().requires_grad_()
        version = leaf._version
        lp, ent = kernel(leaf, tokens, None, with_entropy=True, chunk_size=chunk_size,
                         log_prob_keep_mask=keep, with_entropy_grad=entropy_grad)
        assert lp.dtype == ent.dtype == torch.float32 and lp.numel() == ent.numel() == T
        assert ent.requires_grad == entropy_grad and lp.requires_grad
        loss = (w1 * lp.reshape(-1)).sum() + ((w2 * ent).sum() if entropy_grad else 0)
        loss.backward()
        want_lp, want_ent, want_grad = _oracle(x, tokens, keep, w1, w2, entropy_grad)
        fin = x[torch.isfinite(x)].abs().max().item()
        atol = 8 * 2.0 ** -24 * (fin + math.log(V))
        torch.testing.assert_close(lp.reshape(-1).double(), want_lp, atol=atol, rtol=0)
        torch.testing.assert_close(ent.double(), want_ent, atol=atol, rtol=0)
        assert leaf.grad.dtype == dtype
        out_eps = 0.0 if dtype == torch.float32 else 2.0 ** -8
        gscale = w1.abs().max().item() + (w2.abs().max().item() * (2 + math.log(V)) if entropy_grad else 0)
        torch.testing.assert_close(leaf.grad.double(), want_grad, rtol=out_eps,
                                   atol=atol * gscale + out_eps * want_grad.abs().max().item())
        assert leaf._version == version and torch.equal(leaf.detach(), before[0])
        assert keep is None or torch.equal(keep, before[2])


@pytest.mark.parametrize("name", CONTROLS)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_empty_input(name, requires_grad):
    kernel = _control(name).calculate_log_probs_and_entropy
    x = torch.randn(0, V, dtype=torch.bfloat16, requires_grad=requires_grad)
    for ent_grad in (False, True):
        lp, ent = kernel(x, torch.zeros(0, dtype=torch.long), None, with_entropy=True,
                         log_prob_keep_mask=torch.zeros(0, V, dtype=torch.bool), with_entropy_grad=ent_grad)
        assert lp.numel() == ent.numel() == 0 and lp.dtype == ent.dtype == torch.float32
        assert lp.requires_grad == requires_grad and ent.requires_grad == (requires_grad and ent_grad)
    lp, ent = kernel(x, torch.zeros(0, dtype=torch.long), None)
    assert ent is None and lp.numel() == 0


@pytest.mark.parametrize("name", CONTROLS)
def test_missing_upstream_grads(name):
    """Only one output in the loss: the other's gradient arrives as None and drops its term only."""
    kernel = _control(name).calculate_log_probs_and_entropy
    x, tokens, _keep, w1, w2 = _inputs(torch.float32, False, False)
    for only_entropy in (False, True):
        leaf = x.clone().requires_grad_()
        lp, ent = kernel(leaf, tokens, None, with_entropy=True)
        ((w2 * ent).sum() if only_entropy else (w1 * lp.reshape(-1)).sum()).backward()
        zero = torch.zeros(T)
        _lp, _ent, want = _oracle(x, tokens, None, zero if only_entropy else w1, w2, only_entropy)
        torch.testing.assert_close(leaf.grad.double(), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", CONTROLS)
def test_wrapper_slime_top_p(name):
    """Shifted targets, temperature, and slime's top-p encoding: an empty range keeps only the
    target (log-prob exactly 0), rows the offsets do not reach stay unmasked."""
    wrapper = _control(name).get_log_probs_and_entropy
    g = torch.Generator().manual_seed(1)
    lengths, resp = [5, 4], [3, 2]
    logits = torch.randn(1, sum(lengths), V, generator=g)
    toks = [torch.randint(0, V, (n,), generator=g) for n in lengths]
    ids = [torch.tensor([1, 2, 3]), [4, 5]]
    offsets = [torch.tensor([0, 3, 3]), [0]]  # sample 0: row 0 nucleus {1,2,3}, row 1 empty, row 2 none
    args = SimpleNamespace(log_probs_chunk_size=2, rollout_temperature=0.5, allgather_cp=False)
    _, res = wrapper(logits.clone().requires_grad_(), args=args, unconcat_tokens=toks, total_lengths=lengths,
                     response_lengths=resp, with_entropy=True, top_p_token_ids=ids, top_p_token_offsets=offsets)
    x = logits[0].double() / 0.5
    full = torch.log_softmax(x, -1)
    for i, (o, L, R) in enumerate(zip([0, 5], lengths, resp, strict=True)):
        rows = torch.arange(o + L - R - 1, o + L - 1)
        tgt = toks[i][L - R:]
        want = full[rows, tgt].clone()
        if i == 0:
            kept = torch.full((V,), -math.inf, dtype=torch.float64)
            kept[[1, 2, 3]] = 0
            kept[tgt[0]] = 0
            want[0] = torch.log_softmax(x[rows[0]] + kept, -1)[tgt[0]]
            want[1] = 0.0
        torch.testing.assert_close(res["log_probs"][i].double(), want, atol=1e-5, rtol=0)
        p = full[rows].exp()
        torch.testing.assert_close(res["entropy"][i].double(), -(p * full[rows]).sum(-1), atol=1e-5, rtol=0)
        assert not res["entropy"][i].requires_grad  # entropy_coef absent means 0
    assert res["log_probs"][0][1].item() == 0.0


@pytest.mark.distributed
@pytest.mark.parametrize("name", CONTROLS)
def test_the_harness_finds_nothing_on_a_control(name, harness_pools):
    """Zero false findings: the regression corpus and a few randomized cases of each level at TP 1
    and 2, every check. (The `ci` and `thorough` profiles at TP 1, 2, 4: docs/tolerances.md.)"""
    from harness.driver.explorer import explore, run_corpus
    from harness.driver.runner import Runner

    runner = Runner(f"tests.controls.{name}", collective_timeout_s=6, pools=harness_pools)
    findings = run_corpus(runner, [1, 2])
    for level in runner.target.levels:
        findings += explore(runner, level, [1, 2], 12, seed=5, shrink=False)
    assert not findings, [f"{f.check}: {f.case}: {f.message[:300]}" for f in findings]
