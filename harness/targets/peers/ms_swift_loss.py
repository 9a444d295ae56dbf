"""ms-swift's Megatron GRPO loss side, `MegatronGRPOTrainer.forward_step` (`swift/megatron/trainers/grpo_trainer.py`): the trainer's own caller of `compute_logps_and_entropy_from_logits`.

`forward_step(data_iterator, model)` takes a micro-batch from the iterator, prepares it with the
trainer's `_prepare_batch` (`BaseMegatronTrainer._prepare_batch`, `base.py`: the labels rolled by
one, `torch.roll(labels, -1)`, the packed-sequence parameters from the position ids, the CP slice),
runs the model, divides its output in place by the trainer's `temperature` (`logits.div_`) when that
is not 1, calls `compute_logps_and_entropy_from_logits(logits, labels, compute_entropy=self.compute_entropy)`
(the entropy in its default chunks of 512 rows: the trainer has no chunk setting), and, padding-free,
lays the packed log-probs and entropy out as a right-aligned `[micro_batch_size, max_seq_len]` batch
(`pad_logps_back_to_batch`). It returns the log-probs as the output tensor and the entropy in the
loss function's data (`partial(self.loss_func, data=data)`, `data["per_token_entropy"]`); the GRPO
loss then reads the positions of `completion_mask`.

The adapter builds the micro-batch as ms-swift's collator makes it for a padding-free Megatron run
(`swift/rlhf_trainers/utils.py::collate_to_grpo_micro_batch`): the samples packed into `[1, T]`
`input_ids`, `position_ids` restarting at each sample, `labels` that are -100 on each prompt and the
token ids on its response, the sequence lengths; and the GRPO batch's `completion_mask` in the
trainer's frame (the rolled labels that are not -100, right-aligned to the longest sample) with
`seq_lengths`. The model is a stand-in whose output is the case's logits: a leaf that requires grad,
which no model returns and which refuses the in-place division, comes as an identity node's output on
the same storage (`_Output`: no copy), so the division lands on the caller's logits as it lands on the
model's output. The answer is each sample's row of the log-probs (and entropy) at its
`completion_mask`, what the loss reads. The trainer instance is the lean class `PeerSource.find`
compiles, with what `__init__` sets and `forward_step` reads: `args` (a padding-free causal-LM run at
PP 1 and CP 1, reporting to nothing), `temperature` (the case's `rollout_temperature`),
`compute_entropy` (the case's `with_entropy`: the trainer's `log_entropy or top_entropy_quantile <
1.0`), `micro_batch_size` (the case's samples), `enable_routing_replay` False, and the base trainer's
methods that `_prepare_batch` reaches, bound to it as inherited. The loss is the harness's:
ms-swift has no entropy coefficient (the entropy is a logged metric and a token mask,
`grpo_trainer.py:1079-1108`), so the case's coefficient reaches nothing, and its chunk size neither
(`chunk_size` is declared absent: the cases run unchunked).

Past forms: from #9580 (`b185df1ee`) the GRPO batch comes as `data["grpo_batch"]`; before it the
micro-batch carries `advantages`, `truncated_mask`, `seq_lengths` and `completion_mask` as keys and
`forward_step` filters the model's inputs with `_prepare_model_inputs`. The adapter reads which one
the commit's `forward_step` pops. At #9471 and #9515 `prepare_batch` imports `swift.megatron.utils`
in its body, which runs ms-swift's package `__init__` (modelscope and the rest of its stack): where
that cannot be imported the commit is untestable, with that reason. Before #8427 (`0b1ecca4d`)
`forward_step` has the model compute the loss from the labels when the entropy is off: not this
adapter's layout (its import refuses).

What is provided, and why it is honest: `swift/megatron/utils/megatron_lm_utils.py` imports
`split_cp_inputs` from mcore-bridge (not installed here), which only the CP slice calls (`provides`:
one that raises, at CP 1 never reached). ms-swift's lazy package `__init__`s (`swift/utils/__init__.py`
from `8ce285dbb` on: transformers' `_LazyModule`) are read as any package's: `PeerSource` finds each
name by its import under `if TYPE_CHECKING:`, the submodule the lazy module would import. The TP group is `parallel_state`'s (the adapter
checks it is the harness's).
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import types
from types import SimpleNamespace
from typing import Any

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._mpu import FLOAT16_OUTPUT_FP32, GPT_LOGITS_CONTIGUOUS, NONCONTIGUOUS, parallel_state_group
from harness.targets.peers._source import PeerSource, RoutineMissing

CLONE = "git clone https://github.com/modelscope/ms-swift && export PYTHONPATH=$PWD/ms-swift:$PYTHONPATH"
HOW = f"{CLONE} (its Megatron GRPO trainer's forward_step needs torch, megatron-core, transformers and accelerate)"
_TRAINER, _BASE = "MegatronGRPOTrainer", "BaseMegatronTrainer"


def _no_cp_split(*args: Any, **kwargs: Any) -> Any:
    """mcore-bridge's `split_cp_inputs`, which `get_batch_on_this_cp_rank` calls only at CP > 1."""
    raise NotImplementedError("ms_swift_loss runs at CP 1 (HARNESS_CAPABILITIES['context_parallel'] is False): "
                              "mcore-bridge's split_cp_inputs is not provided")


# `provides`: `swift/megatron/utils/megatron_lm_utils.py` imports `split_cp_inputs` from mcore-bridge (not
# installed here) for the CP slice of `get_batch_on_this_cp_rank`, which CP 1 never reaches.
SOURCE = PeerSource("ms-swift-loss", markers=("swift/megatron",), how=HOW, provides={"split_cp_inputs": _no_cp_split},
                    files=("swift/megatron/trainers/grpo_trainer.py", "swift/megatron/trainers/base.py",
                           "swift/megatron/trainers/utils.py"))

HARNESS = Declaration(
    capabilities={"keep_mask": False, "metric_only_entropy": False, "top_p": False, "context_parallel": False,
                  "chunk_size": False},
    peer=PeerInfo(requires=("megatron.core", "transformers", "accelerate", "swift"), install=HOW, upstream=(
        "swift.megatron.trainers.grpo_trainer.MegatronGRPOTrainer.forward_step",
        "swift.megatron.trainers.base.BaseMegatronTrainer._prepare_batch")),
    use=[
        {"where": {}, "check": "wrapper-gradients", "term": "entropy",
         "why": "swift/megatron/trainers/grpo_trainer.py:1079-1108: the entropy is a logged metric and, through "
                "`entropies >= entropy_threshold`, a token mask; the GRPO loss never differentiates it"},
        {"where": {"regime": "neginf"},
         "why": "swift/megatron/trainers/grpo_trainer.py:900-906: the logits are the model's output, divided by the "
                "temperature; nothing masks them to -inf"},
        {"where": {"T": 0},
         "why": "swift/megatron/trainers/grpo_trainer.py:877-906: the logits are those of a micro-batch of encoded "
                "samples, each with its prompt tokens: never empty"},
        {"where": {"layout": NONCONTIGUOUS},
         "why": f"swift/megatron/trainers/grpo_trainer.py:900: the logits are the model's output; {GPT_LOGITS_CONTIGUOUS}"},
        {"where": {"context": ["accumulate", "two_calls", "two_inputs"]},
         "why": "swift/megatron/trainers/grpo_trainer.py:900-906: one call on each micro-batch's own model output; no "
                "second call or second backward reaches the same logits tensor"},
        {"where": {}, "check": "input-integrity",
         "why": "swift/megatron/trainers/grpo_trainer.py:900-906: the logits are the model's output, divided in place "
                "and read by this call only; what it leaves in them is never read again"},
        {"where": {"dtype": ["bf16", "fp16"]},
         "why": "swift/megatron/utils/megatron_lm_utils.py:521 wraps the model in Float16Module: "
                f"{FLOAT16_OUTPUT_FP32}, so the logits reach forward_step in float32"},
    ],
)


def swift_grpo_step(vp, logits, args, unconcat_tokens, total_lengths, response_lengths, with_entropy=False):
    """`MegatronGRPOTrainer.forward_step` on the packed `[1, T, V_local]` logits
    (`swift/megatron/trainers/grpo_trainer.py:892-906`): the collator's labels (-100 on each prompt)
    rolled by one (`base.py`'s `_prepare_batch`), the division by the trainer's temperature (in place
    on ms-swift's model output; here a new tensor, the caller's logits being a leaf), and
    `compute_logps_and_entropy_from_logits` at its default entropy chunk; each sample's rows at its
    `completion_mask`. Needs only torch and `vp`, ms-swift's `vocab_parallel_utils.py`: `harness
    repro --script` embeds it."""
    labels = torch.cat([torch.as_tensor(t).reshape(-1).long().masked_fill(torch.arange(int(n)) < int(n) - int(r), -100)
                        for t, n, r in zip(unconcat_tokens, total_lengths, response_lengths, strict=True)])  # -100 on each prompt
    out = vp.compute_logps_and_entropy_from_logits(logits / (getattr(args, "rollout_temperature", None) or 1.0),
                                                   torch.roll(labels, -1)[None], compute_entropy=with_entropy)
    ends = torch.tensor(total_lengths, dtype=torch.long).cumsum(0) - 1  # the rows whose rolled label is a response token
    return None, {k: [v[0, e - int(r):e] for e, r in zip(ends.tolist(), response_lengths, strict=True)]
                  for k, v in zip(("log_probs", "entropy"), out, strict=True) if v is not None}


# `harness repro --script`: ms-swift's `vocab_parallel_utils.py`, and the GRPO step over it.
HARNESS = dataclasses.replace(HARNESS, script={
    "name": "ms-swift", "wrapper": swift_grpo_step, "megatron": True,
    "files": {"vp": ("swift/megatron/trainers/vocab_parallel_utils.py",)},
    "how": f"{CLONE} (vocab_parallel_utils.py needs torch and megatron-core only)"})


def _lean(name: str) -> Any:
    """The trainer's lean class holding `name`'s method (None without ms-swift's tree)."""
    return SOURCE.find(name)


_GRPO = _lean(f"{_TRAINER}.forward_step")  # RoutineMissing raises at import where the commit lacks it
_BASE_CLS = _lean(f"{_BASE}._prepare_batch")
# #9471 and #9515 import `prepare_batch` inside `_prepare_batch` (`from .utils import prepare_batch`), a relative
# import run at the call: resolved here, it is found where that import looks, the module `find` made of the file.
if SOURCE.defines("prepare_batch"):
    SOURCE.find("prepare_batch")


def _imports_swift_when_called(rel: str, name: str) -> str:
    """The first module of ms-swift's own package that the function `name` of `rel` imports in its
    body (run at the call, through ms-swift's package `__init__`), or ""."""
    roots = SOURCE.roots()
    path = roots[0] / rel if roots else None
    if path is None or not path.is_file():
        return ""
    for node in ast.parse(path.read_text(encoding="utf-8", errors="replace")).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and not inner.level and (inner.module or "").startswith("swift"):
                    return f"{inner.module} ({rel}:{inner.lineno})"
    return ""


def _names_cuda(rel: str, name: str) -> bool:
    """Whether the function `name` of `rel` names the device 'cuda' (a string constant)."""
    roots = SOURCE.roots()
    path = roots[0] / rel if roots else None
    if path is None or not path.is_file():
        return False
    return any(isinstance(node, ast.FunctionDef) and node.name == name
               and any(isinstance(c, ast.Constant) and c.value == "cuda" for c in ast.walk(node))
               for node in ast.parse(path.read_text(encoding="utf-8", errors="replace")).body)


# #9471 and #9515's `prepare_batch` also imports `swift.megatron.utils` in its body: that runs ms-swift's package
# `__init__` (transformers' lazy module over its whole stack: modelscope, peft, ...). Where it cannot be imported
# here, the commit is untestable, with the reason.
_AT_CALL = _imports_swift_when_called("swift/megatron/trainers/utils.py", "prepare_batch") if _GRPO is not None else ""
if _AT_CALL:
    try:
        importlib.import_module(_AT_CALL.split(" ")[0])
    except ImportError as e:
        raise ImportError(f"ms-swift's prepare_batch imports {_AT_CALL} when called, which runs ms-swift's package "
                          f"__init__: it cannot be imported here ({type(e).__name__}: {e})") from e
# Before #9014 (`662aa3160`) `get_batch_on_this_pp_rank` moves the micro-batch to 'cuda' by name: without CUDA
# such a commit is untestable here, with that reason (on a GPU it runs).
if _GRPO is not None and not torch.cuda.is_available() and _names_cuda("swift/megatron/trainers/utils.py",
                                                                         "get_batch_on_this_pp_rank"):
    raise ImportError("ms-swift's get_batch_on_this_pp_rank (swift/megatron/trainers/utils.py) moves the micro-batch "
                      "to 'cuda' at this commit (before #9014): it runs on a GPU only")
# #9580 on: the GRPO batch is one object, `data.pop('grpo_batch')`; before it, keys of the micro-batch.
_CODE = inspect.unwrap(_GRPO.forward_step).__code__ if _GRPO is not None else None  # under @profiling_decorator
_GRPO_BATCH = _CODE is not None and "grpo_batch" in _CODE.co_consts
if _CODE is not None and "compute_logps_and_entropy_from_logits" not in _CODE.co_names:
    raise RoutineMissing("ms-swift's MegatronGRPOTrainer.forward_step calls no compute_logps_and_entropy_from_logits "
                         "at this commit (before #8427 the model computes the loss from the labels without entropy)")


class _Output(torch.autograd.Function):
    """The model's last op: an identity node whose output is the input's storage (no copy), a tensor of
    the graph and not a leaf, so forward_step's in-place division lands on the caller's logits as it
    lands on the model's output, and the gradient passes unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(0)
        return out.set_(x.untyped_storage(), x.storage_offset(), x.size(), x.stride())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Model:
    """The model as forward_step calls it, `model(**data)`: its output is the case's logits, `[1, T, V_local]`
    (Megatron's GPTModel output, float32 after Float16Module). A leaf that requires grad (or a view of
    one), which no model returns and which refuses an in-place write, comes as `_Output`'s node."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits

    def __call__(self, **inputs: Any) -> torch.Tensor:
        x = self.logits
        return _Output.apply(x) if torch.is_grad_enabled() and x.requires_grad else x


def _trainer(temperature: float, compute_entropy: bool, micro_batch_size: int) -> Any:
    """A lean `MegatronGRPOTrainer` with what its `__init__` sets and `forward_step` reads."""
    trainer = SOURCE.require(_GRPO).__new__(_GRPO)
    # A padding-free causal-LM run (megatron_args.py: padding_free defaults to True) at PP 1 and CP 1.
    trainer.args = SimpleNamespace(task_type="causal_lm", padding_free=True, pipeline_model_parallel_size=1,
                                   context_parallel_size=1, cp_partition_mode="zigzag", is_multimodal=False,
                                   report_to=[])  # `profiling_context` reports to none
    trainer.temperature = temperature  # rollout_mixin.py: `getattr(args, 'temperature', 1.0)`
    trainer.compute_entropy = compute_entropy  # grpo_trainer.py: `log_entropy or top_entropy_quantile < 1.0`
    trainer.micro_batch_size = micro_batch_size
    trainer.enable_routing_replay = False  # base.py: `args.router_replay_mode != 'disabled'`
    # The base trainer's `_prepare_batch` (the labels' roll, the packed-sequence parameters) and the base
    # methods it reaches through `self` (`_should_use_npu_generated_attention_mask` before #9381), as inherited.
    for name, fn in vars(SOURCE.require(_BASE_CLS)).items():
        if isinstance(fn, types.FunctionType) and name not in vars(_GRPO):
            setattr(trainer, name, types.MethodType(fn, trainer))
    return trainer


def _micro_batch(tokens: list[torch.Tensor], lengths: list[int], responses: list[int],
                 device: torch.device) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The collated padding-free micro-batch (`input_ids`, `labels`, `position_ids`, `seq_lens`,
    `num_samples`), the GRPO batch's `completion_mask` `[B, max_seq_len]` (the rolled labels that are
    not -100, right-aligned) and `seq_lengths`."""
    labels = []
    for toks, n, r in zip(tokens, lengths, responses, strict=True):
        lab = toks.clone()  # the collator's labels: a new tensor, -100 on the prompt
        lab[: n - r] = -100
        labels.append(lab)
    cat = (lambda parts: torch.cat(parts).reshape(1, -1)) if tokens else (lambda parts: torch.zeros(1, 0, dtype=torch.long))
    data = {"input_ids": cat(tokens).to(device), "labels": cat(labels).to(device),
            "position_ids": cat([torch.arange(n) for n in lengths]).to(device),
            "seq_lens": list(lengths), "num_samples": len(lengths)}
    width = max(lengths, default=0)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool, device=device)
    for i, r in enumerate(responses):
        if r > 0:
            mask[i, width - r - 1: width - 1] = True  # rows n-r-1 .. n-2 of a right-aligned sample
    return data, mask, torch.tensor(lengths, dtype=torch.long, device=device)


def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths,
                              with_entropy=False, non_loss_data=True, top_p_token_ids=None,
                              top_p_token_offsets=None):
    """Level 2 wrapper over `MegatronGRPOTrainer.forward_step`: each sample's log-probs (and entropy) at
    its `completion_mask`, as the GRPO loss reads them."""
    if top_p_token_ids is not None or top_p_token_offsets is not None:
        raise NotImplementedError("ms-swift's GRPO trainer has no top-p replay (HARNESS_CAPABILITIES['top_p'] is False)")
    if logits.dim() != 3 or logits.shape[0] != 1:
        raise ValueError(f"logits must be [1, T, V_local], got {tuple(logits.shape)}")
    parallel_state_group(None, "ms-swift's Megatron GRPO trainer")
    lengths, responses = [int(n) for n in total_lengths], [int(r) for r in response_lengths]
    tokens = [torch.as_tensor(t).reshape(-1).to(torch.long).cpu() for t in unconcat_tokens]
    for toks, n in zip(tokens, lengths, strict=True):
        if toks.numel() != n:
            raise ValueError(f"sample has {toks.numel()} tokens, total_length says {n}")
    temperature = getattr(args, "rollout_temperature", None)
    trainer = _trainer(1.0 if temperature is None else float(temperature), bool(with_entropy), len(lengths))
    data, completion_mask, seq_lengths = _micro_batch(tokens, lengths, responses, logits.device)
    if _GRPO_BATCH:
        data["grpo_batch"] = SimpleNamespace(completion_mask=completion_mask, seq_lengths=seq_lengths)
    else:
        data.update(completion_mask=completion_mask, seq_lengths=seq_lengths,
                    advantages=torch.zeros(len(lengths), device=logits.device),
                    truncated_mask=torch.zeros(len(lengths), dtype=torch.bool, device=logits.device))
    per_token_logps, loss_func = trainer.forward_step(iter([data]), _Model(logits))
    res = {"log_probs": [row[m] for row, m in zip(per_token_logps, completion_mask, strict=True)]}
    if with_entropy:
        entropy = loss_func.keywords["data"]["per_token_entropy"]
        res["entropy"] = [row[m] for row, m in zip(entropy, completion_mask, strict=True)]
    return torch.empty(0, device=logits.device), res
