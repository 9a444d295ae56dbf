"""verl's Megatron engine's own log-prob and entropy step (`MegatronEngineWithLMHead._lm_head_logits_processor`), with its engine config.

The wrapper level over the code of verl's Megatron engine that receives each micro-batch's model
output (`verl/workers/engine/megatron/transformer_impl.py`): `forward_step` binds
`_lm_head_logits_processor` with the micro-batch's flags (`calculate_entropy`, no Σπ², no top-k
distillation) and verl's model forward calls it on the last pipeline stage's logits, with the
packed labels and per-token temperatures. The processor divides the logits by the temperature in
place, computes the entropy (`vocab_parallel_entropy`, or `vocab_parallel_entropy_with_chunking`
when the engine config's `entropy_from_logits_with_chunking` is set, verl #6446) on them and the
log-probs (`vocab_parallel_log_probs_from_logits`) on `logits.clone()`, or on the logits themselves
without an entropy. The adapter runs that method itself, found in the commit's tree
(`_source.PeerSource.find`, the method in a lean class on an instance holding `engine_config`),
and the engine config is verl's own `McoreEngineConfig`, built from the case:

- `args.log_probs_chunk_size > 0`: `entropy_from_logits_with_chunking=True` with
  `entropy_from_logits_chunk_size` that size; otherwise the unchunked entropy (verl's default).
  verl's chunk size is the entropy's alone: its log-probs are unchunked at any setting;
- `with_entropy`: the micro-batch's `calculate_entropy` (its trainer sets it for the update from
  `actor.calculate_entropy or entropy_coeff != 0`, `verl/trainer/ppo/ray_trainer.py:1336-1338`,
  and True for the old log-probs, :1298-1303); `entropy_coef` reaches nothing else: verl's
  entropy is differentiable whenever it is computed with autograd on (no metric-only flag);
- `args.rollout_temperature` (absent: 1.0): the `[1, T]` float32 temperature of every token, as
  `forward_step` expands the batch's temperature (`transformer_impl.py:1341-1346`) and the model forward packs it;
- the labels: the packed tokens rolled by one, `torch.roll(tokens, -1)`, as the model forward's
  `preprocess_thd_engine(label, need_roll=True)` packs them (`verl/models/mcore/util.py:530-536`;
  at TP 1 and CP 1 it pads nothing and this is its output, at TP > 1 it adds padding rows that
  verl's postprocessing drops); each sample's response rows are then cut out as
  `no_padding_2_padding` cuts them (`verl/workers/utils/padding.py:138`).

verl's logits are the model's output, an autograd node's fresh tensor that the processor may write
into. The harness's logits are the caller's leaf, where an in-place division is refused; the
adapter hands verl the same storage as the output of an identity node (no copy), so verl's
in-place division and the entropy's in-place backward land on the caller's logits, as they land on
verl's model output, and the gradient reaches them unchanged (`_model_output`).

Not claimed: a keep mask (verl has no top-p replay), context parallelism (the processor is
row-local; verl's CP lives in its pre- and post-processing, which all-gather the rows, outside the
code checked here), half-precision logits (Float16Module hands the engine float32). Before verl
#6848 (`1e3b6ffcd`) the processor is a closure inside `forward_step`, which is not found: such a
commit is untestable. `verl` and `verl_chunked` check the same functions composed by hand at the
kernel level.
"""
from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._mpu import parallel_state_group
from harness.targets.peers._source import PeerSource
from harness.targets.peers.verl import FILES
from harness.targets.peers.verl import HOW as TP_HOW  # the script's: tensor_parallel.py alone

HOW = ("pip install verl==0.9.1, or git clone https://github.com/verl-project/verl && export "
       "PYTHONPATH=$PWD/verl:$PYTHONPATH (the processor needs torch, megatron-core and tensordict)")
_ENGINE = "verl/workers/engine/megatron/transformer_impl.py"
SOURCE = PeerSource("verl", files=(_ENGINE, "verl/workers/config/engine.py"),
                    markers=("verl/workers/engine/megatron",), how=HOW)
_METHOD = "MegatronEngineWithLMHead._lm_head_logits_processor"

# None without verl's tree on sys.path; RoutineMissing (untestable) on a commit whose engine has no
# such method (before verl #6848 the processor is a closure inside forward_step).
_CLASS = SOURCE.find(_METHOD)
_CONFIG = SOURCE.find("McoreEngineConfig") if _CLASS is not None else None

_E = _ENGINE
HARNESS = Declaration(
    capabilities={"keep_mask": False, "metric_only_entropy": False, "context_parallel": False},
    peer=PeerInfo(requires=("verl", "megatron.core", "tensordict"), install=HOW, upstream=(
        "verl.workers.engine.megatron.transformer_impl.MegatronEngineWithLMHead._lm_head_logits_processor",
        "verl.workers.config.engine.McoreEngineConfig (entropy_from_logits_with_chunking, entropy_from_logits_chunk_size)")),
    # What verl's own caller makes: `forward_step` (`transformer_impl.py:1235-1415` on verl's main,
    # `1dda039b9`) binds the processor (:1352-1361) and verl's model forward calls it once on the
    # model's output (`verl/models/mcore/model_forward.py:363-376`). The harness's cases beyond it
    # are findings beyond its use (harness.checks.use).
    use=[
        {"where": {"regime": "neginf"},
         "why": f"{_E}:1201: the logits are the model's output divided by the temperature; nothing masks them to -inf"},
        {"where": {"context": ["accumulate", "two_calls", "two_inputs"]},
         "why": "verl/models/mcore/model_forward.py:363-376: the processor runs once on each micro-batch's own model "
                "output; no second call or second backward ever reaches the same logits tensor"},
        {"where": {}, "check": "input-integrity",
         "why": f"{_E}:1201-1231: the processor owns the model's output: it divides it by the temperature in place "
                "(`logits.div_`), computes the entropy on it and the log-probs on `logits.clone()` (or on it, without "
                "an entropy); what the call leaves in it is never read again"},
        {"where": {"T": 0},
         "why": "verl/trainer/ppo/ray_trainer.py:1335: `left_right_2_no_padding` packs each sample's prompt and "
                "response tokens, and a micro-batch holds whole samples: its logits are never empty"},
    ],
)



def verl_lm_head_step(tp, logits, args, unconcat_tokens, total_lengths, response_lengths, with_entropy=False):
    """The engine's `_lm_head_logits_processor` (`verl/workers/engine/megatron/transformer_impl.py:1197-1231`)
    on the packed `[1, T, V_local]` logits, as `forward_step` binds it: the labels rolled by one, the
    temperature's division (in place on verl's model output; here a new tensor, the caller's logits
    being a leaf), the entropy unchunked or, when `McoreEngineConfig.entropy_from_logits_with_chunking`
    is set (`args.log_probs_chunk_size > 0`), in chunks of that many rows, the log-probs on
    `logits.clone()`; each sample's response rows cut as `no_padding_2_padding` cuts them. Needs only
    torch and `tp`, verl's `verl/utils/megatron/tensor_parallel.py`: `harness repro --script` embeds it."""
    label = torch.roll(torch.cat([torch.as_tensor(t).reshape(-1) for t in unconcat_tokens]).long(), -1)[None]
    chunk, logits = getattr(args, "log_probs_chunk_size", None) or -1, logits / (getattr(args, "rollout_temperature", None) or 1.0)
    ret = {"log_probs": tp.vocab_parallel_log_probs_from_logits(logits.clone() if with_entropy else logits, label)}
    if with_entropy:  # in chunks where `McoreEngineConfig` sets `entropy_from_logits_with_chunking` (verl #6446 on)
        ret["entropy"] = tp.vocab_parallel_entropy(logits) if chunk <= 0 else tp.vocab_parallel_entropy_with_chunking(logits, chunk)
    ends = torch.tensor(total_lengths, dtype=torch.long).cumsum(0) - 1  # `no_padding_2_padding`'s cut
    return None, {k: [v[0, e - int(r):e] for e, r in zip(ends.tolist(), response_lengths, strict=True)] for k, v in ret.items()}


# `harness repro --script`: verl's `tensor_parallel.py`, and the engine's step over it.
HARNESS = dataclasses.replace(HARNESS, script={"name": "verl", "files": FILES, "wrapper": verl_lm_head_step,
                                               "megatron": True, "how": TP_HOW})


class _Output(torch.autograd.Function):
    """An identity node whose output shares the input's storage without being a view of it: what
    the model's last op hands verl (a tensor of the graph's, not a leaf), at no copy."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(0).set_(x.untyped_storage(), x.storage_offset(), x.size(), x.stride())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _model_output(logits: torch.Tensor) -> torch.Tensor:
    """The logits as verl's processor receives them: a leaf requiring grad (or a view of one), which
    refuses the in-place division, becomes an identity node's output on the same storage; any other
    tensor is handed over as it is."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return _Output.apply(logits)
    return logits


_CONFIGS: dict[tuple[int, int], Any] = {}


def engine_config(chunk_size: int, tp: int) -> Any:
    """verl's `McoreEngineConfig` with the entropy chunking the case asks for (`chunk_size > 0`: chunked,
    of that many rows; otherwise verl's default, unchunked) at this TP size. Its `__post_init__`
    warns at TP 1 that sequence parallelism is off, a note of no bearing on the processor."""
    key = (chunk_size if chunk_size > 0 else -1, tp)
    if key not in _CONFIGS:
        chunking = {"entropy_from_logits_with_chunking": chunk_size > 0,
                    **({"entropy_from_logits_chunk_size": chunk_size} if chunk_size > 0 else {})}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            _CONFIGS[key] = SOURCE.require(_CONFIG)(tensor_model_parallel_size=tp, sequence_parallel=False, **chunking)
    return _CONFIGS[key]


def engine(config: Any) -> Any:
    """An instance of the lean engine class with what the processor reads of `self`."""
    cls = SOURCE.require(_CLASS)
    instance = cls.__new__(cls)
    instance.engine_config = config
    return instance


def _flags(method: Any, calculate_entropy: bool) -> dict[str, Any]:
    """The keyword arguments `forward_step` binds (:1352-1361), for a plain log-prob micro-batch: no Σπ²,
    no top-k distillation, the THD format (`use_remove_padding`, verl's default); those this commit's
    processor takes."""
    flags = dict(calculate_sum_pi_squared=False, calculate_entropy=calculate_entropy, distillation_use_topk=False,
                 distillation_only=False, logits_processor_func=None, batch=None, data_format="thd")
    taken = inspect.signature(method).parameters
    return {k: v for k, v in flags.items() if k in taken}


def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                              with_entropy=False, non_loss_data=True, top_p_token_ids=None,
                              top_p_token_offsets=None):
    """Level 2 wrapper over verl's `_lm_head_logits_processor`, on the whole packed micro-batch."""
    if top_p_token_ids is not None or top_p_token_offsets is not None:
        raise NotImplementedError("verl has no top-p replay (HARNESS_CAPABILITIES['keep_mask'] is False)")
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"logits must be [1, T, V_local], got {tuple(logits.shape)}")
    from megatron.core import parallel_state as mpu

    if mpu.get_context_parallel_world_size() > 1:
        raise NotImplementedError("verl's processor is row-local; its CP is outside it "
                                  "(HARNESS_CAPABILITIES['context_parallel'] is False)")
    group = parallel_state_group(None, "verl's vocab_parallel functions")
    lengths = [int(n) for n in total_lengths]
    tokens = [torch.as_tensor(t, device=logits.device).reshape(-1).to(torch.long) for t in unconcat_tokens]
    for toks, n in zip(tokens, lengths, strict=True):
        if toks.numel() != n:
            raise ValueError(f"sample has {toks.numel()} tokens, total_length says {n}")
    packed = torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.long, device=logits.device)
    label = torch.roll(packed, -1).unsqueeze(0)  # preprocess_thd_engine(label, need_roll=True) at TP 1, CP 1
    temperature = getattr(args, "rollout_temperature", None)
    temperature = torch.full(label.shape, 1.0 if temperature is None else float(temperature),
                             dtype=torch.float32, device=logits.device)
    chunk = getattr(args, "log_probs_chunk_size", None)
    config = engine_config(int(chunk) if chunk is not None else -1, group.size())
    verl = engine(config)
    ret = verl._lm_head_logits_processor(_model_output(logits), label, temperature,
                                         **_flags(verl._lm_head_logits_processor, bool(with_entropy)))
    res: dict[str, list[torch.Tensor]] = {"log_probs": []}
    if "entropy" in ret:
        res["entropy"] = []
    offset = 0
    for n, r in zip(lengths, response_lengths, strict=True):
        r = int(r)
        end = offset + n - 1  # no_padding_2_padding: values[seq_offset - resp_len - 1 : seq_offset - 1]
        for key in res:
            res[key].append(ret[key][0, end - r:end] if r > 0 else ret[key][0, end:end])
        offset += n
    return torch.empty(0, device=logits.device), res
