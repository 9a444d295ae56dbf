"""prime-rl's chunked LM head, `FusedOutputLinear` (`src/prime_rl/trainer/models/layers/lm_head.py`), at the fused-linear level.

`FusedOutputLinear(in_features, out_features, chunk_size)` replaces a model's `lm_head`; its
`forward(hidden_states [B, S, H], labels [B, S], temperature)` returns the labels' log-probs and
the entropy in float32 (a `PrimeLmOutput`: a dataclass in the first commits, a TypedDict later),
computing the logits per chunk (of the vocabulary in the first commits, of the rows since prime-rl
#1987) in its own autograd function, recomputed in the backward. The adapter calls the module
as prime-rl's trainer does, through `torch.func.functional_call` with the case's LM head as its
`weight` (so the gradient reaches the caller's tensor, and a frozen head stays frozen), the case's
hidden states as a `[1, T, H]` view (`hidden.unsqueeze(0)`: a strided hidden stays strided), and a
temperature of 1 in the form the commit's `forward` takes (a float, or a per-token tensor since
prime-rl #1624). `chunk_size <= 0` is prime-rl's smallest useful chunk, all rows at once.

The entropy is a metric in prime-rl: its backward asserts that no gradient reaches the entropy.
With `with_entropy_grad=False` the adapter hands it back detached, as prime-rl's trainer uses it;
with True it is returned as it is, and a loss through it is the known file's convention entry.
prime-rl is not tensor-parallel (FSDP): at TP > 1 the adapter all-gathers the head's vocab shards
(`_mpu.gather_vocab`). No keep mask.

The file is loaded on its own (`_source`): `prime_rl`'s packages import its trainer's stack
(transformers, its config system). Stubbed, because the routine never calls them:
`prime_rl.utils.logger.get_logger` and `prime_rl.utils.vlm.get_final_logit_softcapping` (used by
`inject_prime_lm_head`, which swaps a model's head; the adapter builds the head itself).
"""
from __future__ import annotations

import dataclasses

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._mpu import gather_vocab
from harness.targets.peers._source import PeerSource, missing

HOW = ("git clone https://github.com/PrimeIntellect-ai/prime-rl && export PYTHONPATH=$PWD/prime-rl/src:$PYTHONPATH "
       "(lm_head.py needs torch only)")


def _unused(*_a, **_k):
    raise RuntimeError("stubbed by the harness: the routine under test never calls this")


SOURCE = PeerSource("prime-rl", files=("prime_rl/trainer/models/layers/lm_head.py",
                                       "src/prime_rl/trainer/models/layers/lm_head.py"),
                    markers=("prime_rl/trainer", "src/prime_rl/trainer"), how=HOW,
                    stubs={"prime_rl.utils.logger": {"get_logger": _unused},
                           "prime_rl.utils.vlm": {"get_final_logit_softcapping": _unused}})
HARNESS = Declaration(
    capabilities={"keep_mask": False, "tensor_parallel": False},
    peer=PeerInfo(requires=("prime_rl",), install=HOW,
                  upstream=("prime_rl.trainer.models.layers.lm_head.FusedOutputLinear",)),
    # What prime-rl's own caller makes: its RL trainer logs the entropy and never differentiates it.
    use=[
        {"where": {"with_entropy": 1, "with_entropy_grad": 1}, "check": "crash",
         "why": "src/prime_rl/trainer/rl/train.py:483 detaches the entropy into a metric, and prime-rl's losses "
                "never put it in the loss (its backward asserts so: src/prime_rl/trainer/models/layers/lm_head.py:161)"},
    ],
)

_LM = SOURCE.load()  # None without prime-rl's tree on sys.path; RoutineMissing when this commit lacks it
if _LM is not None:
    missing(SOURCE, _LM, "FusedOutputLinear")


def prime_rl_head(lm, hidden, weight, tokens, with_entropy=False, chunk_size=-1, with_entropy_grad=True):
    """prime-rl's call of `lm`, its `lm_head.py`, as its trainer makes it: a `FusedOutputLinear` run
    through `torch.func.functional_call` with the caller's head as its weight, the hidden states as
    `[1, T, H]`, a temperature of 1 as the commit's `forward` takes it (a per-token tensor since
    prime-rl #1624), `chunk_size <= 0` all rows at once; the entropy detached unless
    `with_entropy_grad` (a metric in prime-rl). Needs only torch and `lm`: `harness repro --script`
    embeds it. The module's own initialisation draws from a forked RNG (the caller's weight replaces it)."""
    with torch.random.fork_rng(devices=[]):
        head = lm.FusedOutputLinear(hidden.shape[1], weight.shape[0], chunk_size if chunk_size > 0 else max(len(hidden), 1))
    labels = tokens.reshape(1, -1).to(device=hidden.device, dtype=torch.long)
    per_token = "Tensor" in str(type(head).forward.__annotations__.get("temperature"))
    kwargs = {"temperature": torch.ones(labels.shape, device=hidden.device) if per_token else 1.0}
    head = head.to(device=hidden.device, dtype=weight.dtype)
    out = torch.func.functional_call(head, {"weight": weight}, (hidden.unsqueeze(0), labels), kwargs)
    log_prob, entropy = (out["logprobs"], out["entropy"]) if isinstance(out, dict) else (out.logprobs, out.entropy)
    return log_prob.reshape(-1), (entropy if with_entropy_grad else entropy.detach()).reshape(-1) if with_entropy else None


# `harness repro --script`: the file the call needs from prime-rl's tree, and the call itself (TP 1 only:
# prime-rl is not tensor-parallel, and at TP > 1 the adapter, not prime-rl, gathers the head's shards).
HARNESS = dataclasses.replace(HARNESS, script={"name": "prime-rl", "files": {"lm": SOURCE.files},
                                               "linear": prime_rl_head, "how": HOW})


def calculate_linear_log_probs_and_entropy(hidden, weight, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                           with_entropy_grad=True):
    """Fused-linear level over prime-rl: `(log_prob [T] float32, entropy [T] float32 or None)`."""
    return prime_rl_head(SOURCE.require(_LM), hidden, gather_vocab(weight, tp_group, dim=0), tokens, with_entropy,
                         chunk_size, with_entropy_grad)
