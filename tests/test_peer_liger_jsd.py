"""The `liger_jsd` adapter's composition of Liger-Kernel's chunked fused-linear JSD: each divergence the
adapter maps onto Liger's `beta` (forward KL at 0, reverse KL at 1, the JSD between) agrees with the level's
float64 oracle in float32, with ignored labels, a temperature, a hard loss and uneven chunks. Needs Liger's
tree on PYTHONPATH (its `src/` folder, or a commit's root) and skips without it.
"""
from __future__ import annotations

import pytest
import torch

from harness.reference import linear_distill as ref
from harness.targets.declaration import declaration_of
from harness.targets.peers import liger_jsd as adapter


def test_declares_what_it_lacks():
    caps = declaration_of(adapter).capabilities
    assert caps["soft_ce"] is False and caps["teacher_logits"] is False


@pytest.mark.parametrize("kind, beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3)])
def test_divergences_match_the_oracle(kind, beta):
    if adapter._LOSS is None:
        pytest.skip("Liger-Kernel's tree is not on PYTHONPATH: " + adapter.HOW)
    g = torch.Generator().manual_seed(7)
    T, H, Ht, V = 10, 6, 8, 11
    h = torch.randn(T, H, generator=g).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) / H ** 0.5).requires_grad_(True)
    ht, wt = torch.randn(T, Ht, generator=g), torch.randn(V, Ht, generator=g) / Ht ** 0.5
    labels = torch.randint(0, V, (T,), generator=g)
    labels[[1, 4, 5]] = -100
    loss = adapter.linear_distill_loss(h, w, ht, wt, labels, kind=kind, beta=beta, temperature=2.0, hard_weight=0.3,
                                       soft_weight=0.7, chunk_size=3)
    loss.backward()
    want, gh, gw = ref.grads(h.detach(), w.detach(), ht, wt, labels, 1.0, kind=kind, beta=beta, temperature=2.0,
                             hard_weight=0.3, soft_weight=0.7)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-6)
    assert h.grad is not None and w.grad is not None
    torch.testing.assert_close(h.grad.double(), gh, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), gw, rtol=1e-4, atol=1e-6)
