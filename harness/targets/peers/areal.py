"""AReaL's log-probs and entropy (`areal/utils/functional/vocab_parallel.py`), as its FSDP and
Megatron engines call them.

Kernel: `gather_logprobs_entropy(logits, labels, temperature, tp_group=..., chunk_size=1024)` and,
without an entropy, `gather_logprobs`: at TP > 1 its own autograd functions
(`_VocabParallelLogProbsEntropy`, `_VocabParallelLogProbs`: three all-reduces, the backward built
in place on the saved softmax), row-chunked by `_chunked_apply`; at TP 1 a `torch.compile`d
`log_softmax` + `gather` per chunk. Both engines pass the TP group only when its size is above 1
(`areal/engine/megatron_engine.py:2072-2078`, `areal/engine/fsdp_engine.py:1922-1928`) and never
pass a chunk size: the adapter passes the case's chunk size where it is positive and otherwise
leaves AReaL's default of 1024 rows, which is what the engines run (`_chunked_apply` takes no
"all rows" value: 0 is a `range` step error, -1 an empty result).

The packed-tree functions (`areal/models/tree_attn/functional.py`,
`gather_packed_tree_logprobs_entropy`, used when `enable_tree_training` is set) call the same
`gather_logprobs_entropy` once per trie node (chunk 1024) and once per node transition (chunk 1):
the kernel checked here is their arithmetic. Their trie (shared prefixes packed once, the rolled
last position of each sequence) has no mapping onto the wrapper level's packed samples
that AReaL's tree builder would produce for arbitrary tokens, so they are not adapted.

No keep mask, no metric-only entropy flag: autograd alone decides, and AReaL's PPO loss detaches
the entropy (`areal/trainer/ppo/actor.py:434`), so the entropy is always a metric there.

The file is loaded on its own (`_source`): AReaL's package `__init__`s import its trainer. It
imports `is_npu_available` from `areal.infra.platforms` (`areal.platforms` before AReaL #875),
stubbed False: the CUDA (and CPU) path, which compiles the TP-1 helpers. Before AReaL #667 the
routine lived in `areal/utils/functional.py`: from AReaL #459 its TP path took the group from
megatron-core's `parallel_state` (Megatron's `vocab_parallel_cross_entropy` for the log-probs,
AReaL's `_VocabParallelEntropy` from `areal/utils/mcore/functional.py`, loaded from its file for
the stub of that import); before #459 it is not tensor-parallel, and the adapter all-gathers the
shards (`tensor_parallel: False`), as AReaL's FSDP then handed the routine replicated logits.
That file's other imports are stubbed with what the routine never reaches: `TensorDict` (a type
in other functions' annotations) and the Ulysses sequence-parallel helpers (world size 1: the
kernel level has no sequence parallelism).
"""
from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._mpu import GPT_LOGITS_CONTIGUOUS, gather_vocab, parallel_state_group
from harness.targets.peers._source import PeerSource, RoutineMissing, _exec_file, missing

HOW = ("git clone https://github.com/inclusionAI/AReaL && export PYTHONPATH=$PWD/AReaL:$PYTHONPATH "
       "(vocab_parallel.py needs torch only)")
FILES = ("areal/utils/functional/vocab_parallel.py", "areal/utils/functional.py")
MARKERS = ("areal/utils",)
_MCORE_FUNCTIONAL = "areal/utils/mcore/functional.py"


def _not_in_ci() -> bool:
    return False


def _stubs() -> dict:
    """The modules the routine's file imports for what the routine never reaches (module docstring).
    `areal.utils.mcore.functional` holds AReaL's own `_VocabParallelEntropy`, loaded from its file."""
    stubs: dict = {
        "areal.infra.platforms": {"is_npu_available": False},
        "areal.platforms": {"is_npu_available": False},
        "areal.tests.utils": {"is_in_ci": _not_in_ci},  # AReaL #702 only: production is not CI
        "tensordict": {"TensorDict": dict},
        "areal.utils.ulysses": {"get_ulysses_sequence_parallel_group": lambda: None,
                                "get_ulysses_sequence_parallel_world_size": lambda: 1},
    }
    roots = PeerSource("AReaL", files=FILES, markers=MARKERS).roots()
    if roots and (roots[0] / _MCORE_FUNCTIONAL).is_file() and not (roots[0] / FILES[0]).is_file():
        mcore = _exec_file(roots[0] / _MCORE_FUNCTIONAL, "_harness_peer_areal_mcore_functional", {})
        stubs["areal.utils.mcore.functional"] = {"_VocabParallelEntropy": mcore._VocabParallelEntropy}
    return stubs


SOURCE = PeerSource("AReaL", files=FILES, markers=MARKERS, stubs=_stubs(), how=HOW)
try:
    _VP = SOURCE.load()  # None without AReaL's tree on sys.path
except SyntaxError as e:  # AReaL #843 to #991: PEP 695 type parameters, Python 3.12 only
    raise RoutineMissing(f"AReaL's {Path(e.filename or FILES[0]).name} at this commit does not parse on "
                         f"Python {sys.version_info[0]}.{sys.version_info[1]} ({e.msg}, line {e.lineno}): "
                         "AReaL #843 wrote it for Python 3.12 (PEP 695), #991 went back to 3.11") from None
if _VP is not None:
    missing(SOURCE, _VP, "gather_logprobs", "gather_logprobs_entropy")


def _form(vp) -> str:
    """How this commit's routine is tensor-parallel: `group` (it takes `tp_group`, AReaL #667 on),
    `mpu` (megatron-core's parallel_state, #459 to #667), `none` (not at all, before #459)."""
    if "tp_group" in inspect.signature(vp.gather_logprobs_entropy).parameters:
        return "group"
    return "mpu" if hasattr(vp, "mpu") else "none"


_FORM = _form(_VP) if _VP is not None else "group"

HARNESS = Declaration(
    capabilities={"keep_mask": False, "metric_only_entropy": False, "eager": False,
                  **({"tensor_parallel": False} if _FORM == "none" else {})},
    peer=PeerInfo(requires=("areal",), install=HOW, upstream=(
        "areal.utils.functional.vocab_parallel.gather_logprobs_entropy",
        "areal.utils.functional.vocab_parallel.gather_logprobs")),
    # What AReaL's callers make: the engines' loss and forward paths (megatron_engine.py:2072-2078, 2160-2166;
    # fsdp_engine.py:1922-1928, 1952-1958) and, through the tree functions, the same calls per trie node.
    use=[
        {"where": {"regime": "neginf"},
         "why": "areal/engine/megatron_engine.py:2072-2078, areal/engine/fsdp_engine.py:1922-1928: the model's output "
                "logits (divided by the temperature inside the call); nothing masks them to -inf"},
        {"where": {"layout": "transposed"},
         "why": f"areal/engine/megatron_engine.py:2072 gets the model's output as it comes ({GPT_LOGITS_CONTIGUOUS}); "
                "areal/engine/fsdp_engine.py:747 `outputs.logits.squeeze(0)`, the lm_head's local output "
                "(ColwiseParallel, areal/engine/fsdp_utils/parallel.py:309-311): never a transposed view"},
        {"where": {}, "check": "gradients", "term": "entropy",
         "why": "areal/trainer/ppo/actor.py:434 detaches the entropy before the loss, and no other AReaL loss reads it "
                "(areal/trainer/sft/lm_engine.py:83, areal/trainer/dpo/dpo_engine.py:149 take it unused): no caller "
                "differentiates it (before, areal/engine/ppo/actor.py: line 336 at AReaL #459, 418 at #663)"},
        {"where": {"loss_terms": ["both", "entropy"]}, "check": "crash",
         "why": "areal/trainer/ppo/actor.py:434 (areal/engine/ppo/actor.py:336 at AReaL #459, :418 at #663): the entropy is "
                "detached, so no AReaL backward runs through it; a crash that needs the entropy's backward is beyond use"},
        {"where": {"T": 0},
         "why": "areal/engine/megatron_engine.py:1966-1983, areal/engine/fsdp_engine.py:1780-1782: a micro-batch holds whole "
                "sequences of the batch and `pad_mb_list` pads it to a multiple of 256 tokens (areal/utils/data.py:1018-1025); "
                "an empty tree returns before the call (megatron_engine.py:2042-2047, fsdp_engine.py:1999-2002), and the "
                "tree functions skip a node with no internal rows (areal/models/tree_attn/functional.py:115-117): the "
                "logits are never empty"},
    ],
)


def areal_engine(vp, logits, tokens, tp_group, with_entropy=False, chunk_size=-1):
    """AReaL's engines' call (`areal/engine/megatron_engine.py:2072-2078`, `fsdp_engine.py:1922-1928`): the TP
    group only where it has more than one rank, no chunk size (AReaL's 1024 rows) unless the case sets one.
    Needs only torch and `vp`, AReaL's `vocab_parallel.py` (AReaL #667 on): `harness repro --script` embeds it."""
    kw = {"tp_group": tp_group if dist.get_world_size(tp_group) > 1 else None,
          **({"chunk_size": chunk_size} if chunk_size > 0 else {})}
    if with_entropy:
        return vp.gather_logprobs_entropy(logits, tokens.reshape(-1).long(), 1.0, **kw)
    return vp.gather_logprobs(logits, tokens.reshape(-1).long(), 1.0, **kw), None


# `harness repro --script` (AReaL #667 on, the routine's form on main): its file, with the one import of its
# top that the call never reaches stubbed (the NPU switch, False: the CUDA and CPU path), and the call.
HARNESS = dataclasses.replace(HARNESS, script={"name": "AReaL", "files": {"vp": FILES[:1]}, "kernel": areal_engine,
                                               "stubs": {"areal.infra.platforms": {"is_npu_available": "False"}},
                                               "how": HOW})


def _vp():
    return SOURCE.require(_VP)


def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                    log_prob_keep_mask=None, with_entropy_grad=True):
    """Level 1 kernel over AReaL: `(log_prob [T] float32, entropy [T] float32 or None)`."""
    if log_prob_keep_mask is not None:
        raise NotImplementedError("AReaL takes no keep mask (HARNESS capabilities: keep_mask False)")
    vp = _vp()
    form = _form(vp)
    labels = tokens.reshape(-1).to(device=logits.device, dtype=torch.long)
    kwargs: dict = {"chunk_size": chunk_size} if chunk_size > 0 else {}  # the engines pass none: 1024
    x = logits
    if form == "group":
        size = dist.get_world_size(tp_group) if tp_group is not None else 1
        kwargs["tp_group"] = tp_group if size > 1 else None  # the engines' rule
    elif form == "mpu":
        parallel_state_group(tp_group, "AReaL's gather_logprobs (before AReaL #667)")
    else:
        x = gather_vocab(logits, tp_group)  # replicated logits, as AReaL's FSDP then handed them over
    if with_entropy:
        log_prob, entropy = vp.gather_logprobs_entropy(x, labels, 1.0, **kwargs)
        return log_prob, entropy
    return vp.gather_logprobs(x, labels, 1.0, **kwargs), None
