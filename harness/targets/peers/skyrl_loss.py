"""SkyRL's Megatron loss side (`MegatronModelWrapper.forward_backward_mini_batch` and `forward` in `workers/megatron/megatron_model_wrapper.py`), called as its Megatron worker calls it.

The caller level: what SkyRL's model wrapper does between the model's logits and the loss, with
SkyRL's own configuration object (`TrainerConfig`) built from the case. Its `loss_func` divides the
logits by the temperature in place (`logits.div_(temperature)`), calls
`from_parallel_logits_to_logprobs(..., chunk_size=cfg.logprobs_chunk_size)`, keeps the last
`num_actions` columns, and computes the entropy of the action rows with
`vocab_parallel_entropy(logits[:, -num_actions - 1:-1, :], chunk_size=cfg.vocab_entropy_chunk_size,
...)` under `torch.set_grad_enabled(cfg.algorithm.use_entropy_loss)`: the entropy is differentiable
exactly when the entropy loss is on (slime #2153's rule, by construction). `forward`'s
`collection_func` is the no-gradient log-prob pass (reference and old log-probs,
`inference_only=True`); the adapter takes it for the cases under no gradient without entropy, and
`forward_backward_mini_batch(forward_only=...)` for the others.

How the method is reached: `PeerSource.find("MegatronModelWrapper.forward_backward_mini_batch")`
(and `.forward`) compiles the method in a lean class; the adapter's instance has the attributes the
worker's `__init__` sets (`cfg`, `actor_module`, `policy_loss_fn`, padding removal off). The method
runs as it is, up to Megatron's pipeline schedule, which the adapter provides
(`get_forward_backward_func`): a schedule of one pipeline stage that hands each micro-batch's model
output to the loss function the method's `forward_step` returns, as Megatron's
`forward_backward_no_pipelining` does, and leaves the backward to the caller. The model side of
`forward_step` (moving the batch to CUDA, the model call) is not run: the case's logits are the
model's output, which `forward_step` re-pads with SkyRL's `recover_left_padding` (a fresh tensor,
the buffer SkyRL divides in place), and the adapter does the same with that function. The loss
function's per-token outputs come out through two observers that add nothing: the policy loss
function (`self.policy_loss_fn`, a registry entry in SkyRL) records the action log-probs it is given
and returns a zero loss, and `vocab_parallel_entropy` is SkyRL's own, wrapped to record what it
returns. Each sample is one micro-batch of one sequence with no padding (`micro_batch_size` 1),
`num_actions` its response length (1 with an all-zero loss mask for an empty response), so
`remove_microbatch_padding` is off: the non-packed path, the one that calls `vocab_parallel_entropy`.

Not reached: SkyRL's packed path (`remove_microbatch_padding`, its default), whose entropy is a
masked weighted sum with no per-token values (`vocab_parallel_entropy_packed_sequences`); context
parallelism, which SkyRL runs only packed (`remove_left_padding` asserts CP 1); the fused LM-head
path (`skyrl_fused_linear`, hidden states instead of logits). No top-p replay. The TP group is
megatron-core's `parallel_state`'s (the adapter checks it is initialised).
"""
from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._mpu import parallel_state_group
from harness.targets.peers._source import PeerSource

HOW = ("git clone https://github.com/NovaSky-AI/SkyRL && export PYTHONPATH=$PWD/SkyRL:$PYTHONPATH "
       "(the model wrapper's loss side needs torch, megatron-core and omegaconf)")
_MARKERS = ("skyrl/backends", "skyrl-train/skyrl_train")
_WRAPPER = ("skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py",
            "skyrl-train/skyrl_train/workers/megatron/megatron_model_wrapper.py")
_MODEL_UTILS = ("skyrl/backends/skyrl_train/distributed/megatron/model_utils.py",
                "skyrl-train/skyrl_train/distributed/megatron/model_utils.py")
_CONFIG = ("skyrl/train/config/config.py",)


class _Seen:
    """What the observers saw in the call in progress (one call at a time per rank)."""
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


_SEEN = _Seen()
# SkyRL's own vocab_parallel_entropy, compiled from model_utils.py apart from the wrapper's tree.
_ENTROPY_SOURCE = PeerSource("SkyRL-loss-entropy", files=_MODEL_UTILS, markers=_MARKERS, how=HOW)
_REAL_ENTROPY = _ENTROPY_SOURCE.find("vocab_parallel_entropy")


def _entropy_observer(*args: Any, **kwargs: Any) -> torch.Tensor:
    """SkyRL's `vocab_parallel_entropy` with the wrapper's arguments; records its result."""
    out = _ENTROPY_SOURCE.require(_REAL_ENTROPY)(*args, **kwargs)
    _SEEN.entropy = out
    return out


def _policy_loss_observer(action_log_probs: torch.Tensor, *args: Any, **kwargs: Any):
    """The worker's `policy_loss_fn`: records the action log-probs; a zero loss and no metrics."""
    _SEEN.log_probs = action_log_probs
    return torch.zeros((), device=action_log_probs.device), {}


def _closure(fn: Any) -> dict[str, Any]:
    """The names a nested function reads from its enclosing method, with their values."""
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ()), strict=True))


def _schedule(*, forward_step_func, data_iterator, model, num_microbatches, forward_only=False, **_):
    """Megatron's schedule at one pipeline stage, as far as the loss side sees it: each micro-batch's
    model output, re-padded as `forward_step` does (`recover_left_padding`), handed to the loss
    function `forward_step` returns (`loss_func`, or `collection_func` in `forward`); the second
    output of each is collected, as `forward_backward_no_pipelining` collects it. No backward."""
    inner = _closure(forward_step_func)
    process = inner.get("loss_func") or inner["collection_func"]
    recover = forward_step_func.__globals__["recover_left_padding"]
    out = []
    for _ in range(num_microbatches):
        batch = next(data_iterator)
        rows = model[0].output
        mask = batch["attention_mask"].to(torch.bool)
        outputs = recover(rows, mask, mask, rows.shape[1], post_process=True)
        out.append(process(outputs, data=batch)[1])
    return out


SOURCE = PeerSource("SkyRL-loss", files=_WRAPPER, markers=_MARKERS, how=HOW,
                    provides={"get_forward_backward_func": lambda: _schedule,
                              "vocab_parallel_entropy": _entropy_observer})
_CONFIG_SOURCE = PeerSource("SkyRL-loss-config", files=_CONFIG, markers=_MARKERS, how=HOW)
_TRAIN = SOURCE.find("MegatronModelWrapper.forward_backward_mini_batch")  # None without SkyRL's tree
_FORWARD = SOURCE.find("MegatronModelWrapper.forward")
_TRAINER_CONFIG = _CONFIG_SOURCE.find("TrainerConfig") if _CONFIG_SOURCE.defines("TrainerConfig") else None

HARNESS = Declaration(
    capabilities={"keep_mask": False, "context_parallel": False, "allgather_cp": False},
    peer=PeerInfo(requires=("megatron.core", "omegaconf", "skyrl"), install=HOW, upstream=(
        "skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper.MegatronModelWrapper.forward_backward_mini_batch",
        "skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper.MegatronModelWrapper.forward")),
    script={"none": "SkyRL's `loss_func` runs a micro-batch per sample, with `num_actions`, the in-place division and "
                    "the entropy under `set_grad_enabled(use_entropy_loss)`: re-typed, it does not fit an 80-line script "
                    "beside the wrapper level's inputs and judges; the `skyrl` adapter's scripts call the same two "
                    "functions of model_utils.py as `loss_func` calls them"},
    # No case the harness draws at this level is beyond SkyRL's loss side: every layout reaches it as
    # `recover_left_padding`'s fresh copy, float32 only (Float16Module, as the `skyrl` adapter cites).
    use=[],
)


class _Model(torch.nn.Module):
    """The actor module as the wrapper reads it: its config (no MTP heads) and, here, its output."""

    def __init__(self, output: torch.Tensor):
        super().__init__()
        self.config = SimpleNamespace(mtp_num_layers=None)
        self.output = output


def _config(args: Any) -> Any:
    """SkyRL's `TrainerConfig` (its defaults) with what the case sets: the chunk sizes, the entropy
    loss and its coefficient, the PPO policy loss, no KL loss, no fused LM head."""
    cfg = _TRAINER_CONFIG() if _TRAINER_CONFIG is not None else SimpleNamespace(
        algorithm=SimpleNamespace(kl_estimator_type="k3", kl_loss_coef=0.0),
        policy=SimpleNamespace(megatron_config=SimpleNamespace(mtp_loss_weight=0.0, mtp_loss_chunk_size=None,
                                                               mtp_loss_topk=None)),
        vocab_entropy_chunk_memory_mb=512)
    chunk = getattr(args, "log_probs_chunk_size", None)
    chunk = int(chunk) if chunk is not None and int(chunk) > 0 else None
    coef = float(getattr(args, "entropy_coef", 0.0) or 0.0)
    cfg.logprobs_chunk_size = chunk
    cfg.vocab_entropy_chunk_size = chunk
    cfg.remove_microbatch_padding = False
    cfg.use_sample_packing = False
    cfg.fused_lm_head_logprob = False
    cfg.algorithm.policy_loss_type = "regular"
    cfg.algorithm.use_entropy_loss = coef != 0.0
    cfg.algorithm.entropy_loss_coef = coef
    cfg.algorithm.use_kl_loss = False
    return cfg


def _wrapper(cls: Any, cfg: Any, output: torch.Tensor) -> Any:
    """The lean wrapper class's instance, with what `MegatronModelWrapper.__init__` sets."""
    w = cls.__new__(cls)
    w.cfg, w.actor_module, w.actor_optimizer = cfg, [_Model(output)], None
    w.policy_loss_fn = _policy_loss_observer
    w.remove_microbatch_padding = w.use_sample_packing = False
    w.is_vlm, w._fused_lm_head, w._fused_lm_head_backend = False, False, "torch"
    w._pending_grad_sync = None
    return w


def _micro_batch(tokens: torch.Tensor, num_actions: int, response: int) -> dict:
    """One sequence as SkyRL's worker batches it: no padding, the response the last `response`
    tokens, its loss mask over the last `num_actions` columns."""
    device = tokens.device
    L = tokens.numel()
    mask = torch.zeros((1, num_actions), dtype=torch.float32, device=device)
    if response:
        mask[:, num_actions - response:] = 1.0
    zeros = torch.zeros((1, num_actions), dtype=torch.float32, device=device)
    return {"sequences": tokens.reshape(1, L), "attention_mask": torch.ones((1, L), dtype=torch.long, device=device),
            "position_ids": torch.arange(L, device=device).reshape(1, L), "num_actions": num_actions,
            "old_action_log_probs": zeros, "base_action_log_probs": zeros, "advantages": zeros,
            "loss_mask": mask, "response_mask": mask, "action_mask": mask, "rollout_action_logprobs": None,
            "rollout_expert_indices": None, "num_microbatches": 1, "num_real_microbatches": 1}


def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                              with_entropy=False, non_loss_data=True, top_p_token_ids=None,
                              top_p_token_offsets=None):
    """Level 2 over SkyRL's `MegatronModelWrapper` loss side, one micro-batch per sample."""
    if top_p_token_ids is not None or top_p_token_offsets is not None:
        raise NotImplementedError("SkyRL has no top-p replay (HARNESS_CAPABILITIES['keep_mask'] is False)")
    if getattr(args, "allgather_cp", False):
        raise NotImplementedError("SkyRL's loss side is not checked under context parallelism")
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"logits must be [1, T, V_local], got {tuple(logits.shape)}")
    train, forward = SOURCE.require(_TRAIN), SOURCE.require(_FORWARD)
    parallel_state_group(None, "SkyRL's Megatron model wrapper")
    temperature = getattr(args, "rollout_temperature", None)
    temperature = 1.0 if temperature is None else float(temperature)
    cfg = _config(args)
    grad = torch.is_grad_enabled()
    # `forward_only` (SkyRL #1667 on): the loss without a backward, as its `forward(loss_fn=...)` runs it.
    only = {"forward_only": not grad} if "forward_only" in inspect.signature(train.forward_backward_mini_batch).parameters \
        else {}
    log_probs, entropy = [], []
    start = 0
    for toks, L, R in zip(unconcat_tokens, total_lengths, response_lengths, strict=True):
        L, R = int(L), int(R)
        tokens = torch.as_tensor(toks, device=logits.device).reshape(-1).to(torch.long)
        if tokens.numel() != L:
            raise ValueError(f"sample has {tokens.numel()} tokens, total_length says {L}")
        rows = logits[:, start:start + L, :]
        start += L
        num_actions = max(R, 1)
        batch = _micro_batch(tokens, num_actions, R)
        _SEEN.log_probs = _SEEN.entropy = None
        if not grad and not with_entropy:  # the reference / old log-prob pass
            lp = _wrapper(forward, cfg, rows).forward([batch], seq_len=L, micro_batch_size=1, temperature=temperature)
        else:
            _wrapper(train, cfg, rows).forward_backward_mini_batch([batch], seq_len=L, micro_batch_size=1,
                                                                   temperature=temperature, **only)
            lp, ent = _SEEN.log_probs, _SEEN.entropy
            if lp is None or (with_entropy and ent is None):
                raise RuntimeError("SkyRL's loss_func called no policy loss or no vocab_parallel_entropy at this commit")
            if with_entropy and ent is not None:
                entropy.append(ent[0, num_actions - R:])
        _SEEN.log_probs = _SEEN.entropy = None  # the observers keep nothing alive past the call
        log_probs.append(lp[0, num_actions - R:])
    res = {"log_probs": log_probs}
    if with_entropy:
        res["entropy"] = entropy
    return torch.empty(0, device=logits.device), res
