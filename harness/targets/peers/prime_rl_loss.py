"""prime-rl's RL train step on the model's logits (`selective_log_softmax`, `compute_entropy`, `src/prime_rl/trainer/rl/loss.py`), at the wrapper level.

prime-rl computes its log-probs in one of two places, chosen by `model.fused_lm_head_token_chunk_size`
(`packages/prime-rl-configs/src/prime_rl/configs/trainer.py:262`): an int (8192 by default) puts
`FusedOutputLinear` in the model, which starts from the hidden states (the `prime_rl` adapter, at the
fused-linear level); `"disabled"` puts `VanillaOutputLinear` (`src/prime_rl/trainer/model.py:1349-1352`),
whose logits come out of the model and are turned into log-probs and entropy by the train step
(`src/prime_rl/trainer/rl/train.py:436-456`). This adapter is that second path, the one that takes
logits, composed as the train step composes it:

- the labels are the packed tokens shifted left (`shift_tensor_left(input_ids)`, train.py:381);
- the logits are divided by the per-token temperatures (`logits / temperatures.unsqueeze(-1)`,
  train.py:415, 441; a float32 `[1, T]` tensor, `rl/data.py:218`), here every token's
  `args.rollout_temperature` (prime-rl #1624 made them per token: before it, one float per
  micro-batch, the same division);
- `selective_log_softmax(scaled_logits, labels)` and `compute_entropy(scaled_logits)`, both
  `torch.compile(dynamic=True)`, the entropy under `torch.no_grad()`;
- both shifted right (`shift_tensor_right`, the pads `log(1/V)` and `log V`) and split per sample
  (`.squeeze().split(sequence_lengths)`, train.py:452-462), of which the loss takes the response
  tokens (its loss mask): a sample's last `response_lengths[i]` entries.

Commits before prime-rl #1525 (the fused LM head) shift the logits instead (`shift_logits`: the
last row dropped, a zero row in front), divide them by the micro-batch's one temperature and
gather the input ids; the adapter follows the commit's `loss.py` (`_labels_form`).

What prime-rl has no knob for, the adapter has not either. The logits path is not chunked
(`"chunk_size": False`: its cases run unchunked). prime-rl has no entropy coefficient: its entropy
is a metric, computed without autograd and detached into the logs (train.py:483), so with
`entropy_coef != 0` the entropy has no gradient (slime #2153's rule; beyond prime-rl's use). The
model's output reaches the train step in float32 (`cast_float_and_contiguous`,
`src/prime_rl/trainer/model.py:1478-1482`), so no half-precision wrapper cases. prime-rl's context
parallelism cuts the packed sequence into contiguous pieces (`shard_for_cp`, `src/prime_rl/utils/cp.py`)
and has no zigzag layout, which every CP case of the harness may draw: CP is not declared. No top-p
replay. prime-rl is FSDP, not tensor-parallel: at TP > 1 the adapter all-gathers the vocab shards
(`_mpu.gather_vocab`, TP group from megatron-core's `parallel_state`), as a TP trainer must.

The functions are compiled alone from `loss.py` (`PeerSource.find`: the file imports prime-rl's
config package). Its decorator `@jaxtyped(typechecker=beartype)` checks the annotated shapes at run
time (`Float[Tensor, "batch seq vocab"]`, `Int[Tensor, "batch seq"]`) and changes no value; the
adapter provides it as the identity, and `Float`/`Int`/`Bool` as plain annotations, so jaxtyping
and beartype need not be installed (every call here passes that check: float32 `[1, T, V]` logits,
int64 `[1, T]` labels).
"""
from __future__ import annotations

from typing import Any

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._mpu import NONCONTIGUOUS, gather_vocab, parallel_state_group
from harness.targets.peers._source import PeerSource

HOW = ("git clone https://github.com/PrimeIntellect-ai/prime-rl && export PYTHONPATH=$PWD/prime-rl/src:$PYTHONPATH "
       "(its functions need torch only)")


def _jaxtyped(fn=None, **_kw):
    """jaxtyping's run-time shape check, as the identity: it checks, and changes no value."""
    return fn if fn is not None else (lambda f: f)


class _Annotation:
    """jaxtyping's `Float[Tensor, "..."]` in an annotation: only `_jaxtyped` would read it."""

    def __getitem__(self, _item: Any) -> type:
        return torch.Tensor


SOURCE = PeerSource("prime-rl", files=("src/prime_rl/trainer/rl/loss.py", "prime_rl/trainer/rl/loss.py"),
                    markers=("src/prime_rl/trainer", "prime_rl/trainer"), how=HOW,
                    provides={"jaxtyped": _jaxtyped, "typechecker": None,
                              "Float": _Annotation(), "Int": _Annotation(), "Bool": _Annotation()})

HARNESS = Declaration(
    capabilities={"keep_mask": False, "top_p": False, "context_parallel": False, "allgather_cp": False,
                  "chunk_size": False, "tensor_parallel": False, "eager": False},
    peer=PeerInfo(requires=("prime_rl",), install=HOW,
                  upstream=("prime_rl.trainer.rl.loss.selective_log_softmax",
                            "prime_rl.trainer.rl.loss.compute_entropy",
                            "prime_rl.trainer.rl.loss.shift_tensor_left (shift_tensor_right; shift_logits before #1525)")),
    script={"none": "its train step's functions live in src/prime_rl/trainer/rl/loss.py, whose top imports prime-rl's "
                    "config package, beartype and jaxtyping (the adapter compiles each function alone, "
                    "harness.targets.peers._source); prime-rl is not tensor-parallel, and its fused LM head, the "
                    "default path, has scripts through the `prime_rl` adapter"},
    # What prime-rl's own caller makes (`src/prime_rl/trainer/rl/train.py`); the harness's cases beyond
    # it are findings beyond its use (harness.checks.use).
    use=[
        {"where": {"with_entropy": 1}, "check": ["entropy-coef-rule", "wrapper-gradients"], "term": "entropy",
         "why": "src/prime_rl/trainer/rl/loss.py:57-63: `compute_entropy` runs under torch.no_grad(), and "
                "src/prime_rl/trainer/rl/train.py:483 detaches the entropy into the logs: prime-rl has no entropy "
                "coefficient (`compute_loss`, loss.py:285-298, takes no entropy), so entropy_coef != 0 is no input of its"},
        {"where": {"T": 1},
         "why": "src/prime_rl/orchestrator/trajectories.py:69-89: a training sample is a branch with at least one "
                "sampled token, sampled after its prompt, so a packed micro-batch holds at least two tokens; "
                "at T == 1 the train step's `.squeeze().split(sequence_lengths)` (train.py:462) gets a 0-d tensor"},
        {"where": {"layout": NONCONTIGUOUS},
         "why": "src/prime_rl/trainer/model.py:1478-1482: `forward` returns the logits through "
                "`cast_float_and_contiguous` (`.float().contiguous()`, src/prime_rl/trainer/models/layers/lm_head.py:23-34)"},
    ],
)


def _find(name: str):
    """`name` from the `loss.py` of the prime-rl tree first on sys.path (`PeerSource.find` keeps what it compiled)."""
    return SOURCE.require(SOURCE.find(name))


if SOURCE.roots():  # prime-rl's tree on sys.path: a commit without the functions is refused at import
    for _name in ("selective_log_softmax", "compute_entropy"):
        _find(_name)


def _labels_form() -> bool:
    """Whether this commit's train step shifts the labels (`shift_tensor_left`, prime-rl #1525 on)
    rather than the logits (`shift_logits`)."""
    return bool(SOURCE.defines("shift_tensor_left"))


def train_step(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """prime-rl's train step from the model's full-vocab logits `[1, T, V]` and the packed input ids
    `[1, T]` to the per-token log-probs and entropy `[1, T]`, entry t about token t (the first a pad),
    with the commit's `loss.py` functions."""
    select, entropy_of = _find("selective_log_softmax"), _find("compute_entropy")
    if not _labels_form():
        shifted_logits = _find("shift_logits")(logits) / temperature
        return select(shifted_logits, input_ids), entropy_of(shifted_logits)
    vocab = logits.shape[-1]
    labels = _find("shift_tensor_left")(input_ids)
    temperatures = torch.full(input_ids.shape, temperature, dtype=torch.float32, device=logits.device)
    scaled_logits = logits / temperatures.unsqueeze(-1)
    log_probs, entropy = select(scaled_logits, labels), entropy_of(scaled_logits)
    shift_right = _find("shift_tensor_right")
    log_probs = shift_right(log_probs, pad_value=torch.log(torch.tensor(1.0 / vocab)).item())
    entropy = shift_right(entropy, pad_value=torch.log(torch.tensor(float(vocab))).item())
    return log_probs, entropy


def sample_rows(values: torch.Tensor, total_lengths: list[int], response_lengths: list[int]) -> list[torch.Tensor]:
    """The train step's split of `[1, T]` per-token values (`.squeeze().split(sequence_lengths)`),
    and each sample's response tokens, its last `response_lengths[i]` entries (the loss mask)."""
    per_sample = values.squeeze().split(total_lengths)
    return [row[row.shape[0] - int(r):] for row, r in zip(per_sample, response_lengths, strict=True)]


def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                              with_entropy=False, non_loss_data=True, top_p_token_ids=None,
                              top_p_token_offsets=None):
    """Level 2 wrapper over prime-rl's train step on the logits (`fused_lm_head_token_chunk_size = "disabled"`)."""
    if top_p_token_ids is not None or top_p_token_offsets is not None:
        raise NotImplementedError("prime-rl has no top-p replay (HARNESS_CAPABILITIES['top_p'] is False)")
    if getattr(args, "allgather_cp", False):
        raise NotImplementedError("prime-rl's context parallelism is not checked here "
                                  "(HARNESS_CAPABILITIES['context_parallel'] is False)")
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"logits must be [1, T, V_local], got {tuple(logits.shape)}")
    from megatron.core import parallel_state as mpu

    if mpu.get_context_parallel_world_size() > 1:
        raise NotImplementedError("prime-rl's context parallelism is not checked here "
                                  "(HARNESS_CAPABILITIES['context_parallel'] is False)")
    lengths = [int(n) for n in total_lengths]
    tokens = [torch.as_tensor(t).reshape(-1) for t in unconcat_tokens]
    for toks, n in zip(tokens, lengths, strict=True):
        if toks.numel() != n:
            raise ValueError(f"sample has {toks.numel()} tokens, total_length says {n}")
    # The packed micro-batch's input ids, int64 on the logits' device, as the train step holds them.
    input_ids = torch.cat(tokens).to(device=logits.device, dtype=torch.long).unsqueeze(0)
    full = gather_vocab(logits, parallel_state_group(None, "the harness's TP group"), dim=-1)
    log_probs, entropy = train_step(full, input_ids, float(getattr(args, "rollout_temperature", 1.0)))
    # The train step computes the entropy whatever the loss takes; the contract returns it when asked.
    res = {"log_probs": sample_rows(log_probs, lengths, list(response_lengths))}
    if with_entropy:
        res["entropy"] = sample_rows(entropy, lengths, list(response_lengths))
    return torch.empty(0, device=logits.device), res
