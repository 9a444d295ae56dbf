"""The distillation level (docs/distill.md): its float64 oracle against torch's own float64 functions."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from harness.reference import distill as ref


def _rows(seed: int, T: int = 5, V: int = 11, neginf: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s, t = torch.randn(T, V, generator=g, dtype=torch.float64) * 2, torch.randn(T, V, generator=g, dtype=torch.float64) * 2
    if neginf:  # a masked vocabulary: the same entries -inf in both, one entry per row kept
        masked = torch.rand(T, V, generator=g) < 0.4
        masked[:, 0] = False
        s, t = s.masked_fill(masked, -math.inf), t.masked_fill(masked, -math.inf)
    return s, t


@pytest.mark.parametrize("neginf", [False, True])
def test_full_vocabulary_divergences_match_torch(neginf: bool) -> None:
    s, t = _rows(1, neginf=neginf)
    ls, lt = F.log_softmax(s, -1), F.log_softmax(t, -1)
    kl = lambda inp, tgt: F.kl_div(inp, tgt, reduction="none", log_target=True).nan_to_num(0.0).sum(-1)  # noqa: E731
    forward, reverse = kl(ls, lt), kl(lt, ls)
    torch.testing.assert_close(ref.divergence(s, t, kind="forward_kl"), forward, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref.divergence(s, t, kind="reverse_kl"), reverse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref.divergence(s, t, kind="mixed", beta=0.3), 0.3 * forward + 0.7 * reverse,
                               rtol=1e-12, atol=1e-12)
    soft_ce = -(lt.exp() * ls.nan_to_num(neginf=0.0)).sum(-1)
    torch.testing.assert_close(ref.divergence(s, t, kind="soft_ce"), soft_ce, rtol=1e-12, atol=1e-12)
    # The generalized JSD as TRL and ms-swift write it: m = beta p_t + (1 - beta) p_s.
    beta = 0.25
    lm = torch.logsumexp(torch.stack([lt + math.log(beta), ls + math.log(1 - beta)]), dim=0)
    jsd = beta * kl(lm, lt) + (1 - beta) * kl(lm, ls)
    torch.testing.assert_close(ref.divergence(s, t, kind="jsd", beta=beta), jsd, rtol=1e-12, atol=1e-12)
    # KL(p, p) = 0 for every divergence but the soft cross-entropy (the entropy, there).
    for kind in ("forward_kl", "reverse_kl", "jsd", "mixed"):
        torch.testing.assert_close(ref.divergence(s, s, kind=kind), torch.zeros(s.shape[0], dtype=torch.float64),
                                   rtol=0, atol=1e-12)


def test_topk_gather_and_log_softmax_match_torch() -> None:
    s, _ = _rows(2, V=13)
    torch.testing.assert_close(ref.log_softmax(s, 0.7), F.log_softmax(s / 0.7, -1), rtol=1e-14, atol=1e-14)
    values, ids = ref.topk(s, 4)
    want = torch.topk(F.log_softmax(s, -1), 4)
    torch.testing.assert_close(values, want.values, rtol=1e-14, atol=1e-14)
    assert ids.shape == (5, 4) and ref.topk(s, 99)[1].shape == (5, 13)  # k beyond V: the whole row
    torch.testing.assert_close(ref.topk_threshold(s, 4), torch.topk(s, 4).values[:, -1], rtol=0, atol=0)
    torch.testing.assert_close(ref.gather(s, ids), F.log_softmax(s, -1).gather(-1, ids), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(ref.gather(s, ids, renormalize=True), F.log_softmax(s.gather(-1, ids), -1),
                               rtol=1e-14, atol=1e-14)


def test_ties_break_toward_the_lower_id() -> None:
    x = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0]])
    assert ref.topk(x, 2)[1].tolist() == [[1, 2]]
    assert ref.topk_threshold(x, 4).item() == 1.0


def test_top_k_support_renormalized_or_not() -> None:
    s, t = _rows(3, V=9)
    lp_t, ids = ref.topk(t, 3)
    # Renormalized: both teacher and student restricted to the teacher's top-k.
    ps, pt = F.softmax(s.gather(-1, ids), -1), F.softmax(t.gather(-1, ids), -1)
    want = (pt * (pt.log() - ps.log())).sum(-1)
    torch.testing.assert_close(ref.divergence(s, t, k=3), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ref.divergence(s, teacher_log_probs=lp_t, teacher_ids=ids), want, rtol=1e-12,
                               atol=1e-12)
    # Not renormalized: the whole vocabulary's probabilities at the support (verl's top-k KL).
    ls_full = F.log_softmax(s, -1).gather(-1, ids)
    want = (lp_t.exp() * (lp_t - ls_full)).sum(-1)
    torch.testing.assert_close(ref.divergence(s, teacher_log_probs=lp_t, teacher_ids=ids, renormalize=False), want,
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ref.KINDS)
def test_gradients_are_finite_at_a_masked_vocabulary(kind: str) -> None:
    """Terms with both probabilities 0 have no gradient, and none turns NaN."""
    s, t = _rows(4, neginf=True)
    s, t = s.requires_grad_(), t.requires_grad_()
    ref.divergence(s, t, kind=kind, beta=0.4).sum().backward()
    assert s.grad is not None and t.grad is not None
    assert torch.isfinite(s.grad).all() and torch.isfinite(t.grad).all()
    assert (s.grad[s.detach() == -math.inf] == 0).all()
    # Against torch's own: forward KL's student gradient is p_s - p_t.
    if kind == "forward_kl":
        torch.testing.assert_close(s.grad, F.softmax(s.detach(), -1) - F.softmax(t.detach(), -1), rtol=1e-12,
                                   atol=1e-12)


def test_an_infinite_divergence_where_the_student_has_no_mass() -> None:
    s = torch.tensor([[0.0, -math.inf]], dtype=torch.float64)
    t = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    assert ref.divergence(s, t, kind="forward_kl").item() == math.inf
    assert ref.divergence(s, t, kind="reverse_kl").item() == pytest.approx(math.log(2))
