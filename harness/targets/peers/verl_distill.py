"""verl's Megatron top-k forward KL (`verl/trainer/distillation/megatron/losses.py::_VocabParallelKLDivergence`), as its distillation loss composes it.

With `loss_mode="forward_kl_topk"` on the Megatron strategy, verl's logits processor
(`verl/trainer/distillation/losses.py:124-156`) calls `compute_forward_kl_topk(student_logits,
teacher_topk_log_probs, teacher_topk_ids, config, data_format)` on the student's vocab-sharded
logits and a teacher pass's top-k log-probs and global ids (vLLM's, over the whole vocabulary, not
renormalized). That splits the teacher's tensors over the CP ranks (the identity at CP 1) and calls
`_VocabParallelKLDivergence.apply(student_logits, teacher_topk_log_probs, teacher_topk_ids,
log_prob_min_clamp)`, whose first output is the per-token `Σ_{v in S} q_v (log q_v - log p_v)` with
the student's whole-vocabulary log-probs `p` and the teacher's as given: the contract's `forward_kl`
from a `given` teacher without renormalization. The adapter calls the autograd function with
`[1, T, V_local]` logits and the `[1, T, k]` teacher, as `compute_forward_kl_topk` does at CP 1.

`log_prob_min_clamp`: verl's default is -10.0 (`verl/workers/config/distillation.py:70`), which clamps
log-probs below -10 (and drops their gradient): a deliberate bound on the KL's terms, not the KL.
The harness's rows put much of their tail below -10 (a planted top entry 8 above the rest), so the
adapter runs the function with `log_prob_min_clamp=None`, which verl's config allows ("If None, no
clamping is applied", `distillation.py:45-47`), and checks the KL itself.

The autograd function is found by what it is (`_source.PeerSource.find`): the class
`_VocabParallelKLDivergence` in `verl/trainer/distillation/megatron/losses.py`, compiled alone with
the names it reads, so nothing of verl is stubbed: the file's other imports (`verl.workers.config`'s
config classes, `verl.models.mcore.util`'s CP splitters) are never reached, and on the development
branch (pull request #5041) its `vocab_parallel_softmax` / `vocab_parallel_log_softmax` come from
`verl/trainer/distillation/megatron/utils.py`, read as a file, not through verl's package
`__init__`s. Its forms: before `19e2c9d4d` ("Clamping") it takes no `log_prob_min_clamp` and
returns the per-token KL alone; later it returns a tuple whose first entry is the KL. Before
`b89f42439` ("Working top-k megatron loss") there is no such class: the commit is `untestable`. The
TP group is `parallel_state`'s (the adapter checks it is the harness's); megatron-core provides
`calculate_logits_max` and `VocabUtility`. `calculate_logits_max` is megatron-core's, compiled by
its `jit_fuser` (torch.compile), not verl's: the adapter runs it eager (dynamo off around the call),
since compiling each new shape cost over a second a case and what is checked is verl's arithmetic.
Production runs it compiled, so the declaration keeps `"eager": False` and the memory checks say
"not applied" (docs/peers.md).

Its trainer's use: the student's logits are the model's raw output (`verl/workers/engine/megatron/
transformer_impl.py`), never -inf; the teacher's log-probs come from its rollout engine's top-k
(`data["teacher_logprobs"]`, `losses.py:152`). `HARNESS_USE` lists the cases beyond its use.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch

from harness.targets.declaration import Declaration, PeerInfo
from harness.targets.peers._mpu import parallel_state_group
from harness.targets.peers._source import PeerSource

HOW = ("git clone https://github.com/verl-project/verl && export PYTHONPATH=$PWD/verl:$PYTHONPATH "
       "(its Megatron distillation losses need torch and megatron-core only)")
SOURCE = PeerSource("verl-distillation", files=("verl/trainer/distillation/megatron/losses.py",),
                    markers=("verl/trainer",), how=HOW)
HARNESS = Declaration(
    capabilities={"distill_log_softmax": False, "distill_topk": False, "distill_gather": False,
                  "full_teacher": False, "topk_teacher": False, "reverse_kl": False, "jsd": False,
                  "mixed": False, "soft_ce": False, "renormalized": False, "temperature": False,
                  "teacher_grad": False, "eager": False},
    # `harness peers` checks it at the smoke profile, set when the helper compiled each shape (85 s for a
    # smoke check at TP 1, 2 on two cores; 11 s eager).
    peer=PeerInfo(requires=("megatron.core", "verl"), install=HOW, profile="smoke", upstream=(
        "verl.trainer.distillation.megatron.losses._VocabParallelKLDivergence",)),
    use=[
        {"where": {"regime": "neginf"},
         "why": "the student's logits are the Megatron model's raw output, never -inf: "
                "verl/trainer/distillation/losses.py:150-156"},
    ],
)

# None without verl's tree on sys.path; RoutineMissing when this commit has no such class
_KL = SOURCE.find("_VocabParallelKLDivergence")


def distill_divergence(student_logits, tp_group, *, teacher_logits=None, teacher_topk_log_probs=None,
                       teacher_topk_indices=None, k=0, kind="forward_kl", beta=0.5, temperature=1.0,
                       renormalize=True, chunk_size=-1):
    """The per-token forward KL of `_VocabParallelKLDivergence` from a teacher pass's top-k."""
    if teacher_topk_log_probs is None or teacher_topk_indices is None or kind != "forward_kl" or renormalize \
            or temperature != 1.0:
        raise NotImplementedError("verl's Megatron top-k loss is the forward KL from a teacher pass's top-k log-probs, "
                                  "without renormalization or temperature (HARNESS_CAPABILITIES)")
    parallel_state_group(tp_group, "verl's _VocabParallelKLDivergence")
    kl = SOURCE.require(_KL)
    args = [student_logits.unsqueeze(0), teacher_topk_log_probs.unsqueeze(0), teacher_topk_indices.unsqueeze(0)]
    if len(inspect.signature(kl.forward).parameters) > 4:  # ctx, the three tensors and, from 19e2c9d4d, the clamp
        args.append(None)
    with torch._dynamo.config.patch(disable=True):  # megatron-core's jit_fuser'd helper, run eager (docstring)
        out = kl.apply(*args)
    return (out[0] if isinstance(out, tuple) else out)[0]


def verl_topk_kl(losses, student_logits, tp_group, *, teacher_topk_log_probs, teacher_topk_indices, kind="forward_kl", renormalize=True, temperature=1.0):  # noqa: E501
    """verl's `_VocabParallelKLDivergence` (`losses`, `verl/trainer/distillation/megatron/losses.py`)
    as `compute_forward_kl_topk` applies it at CP 1, without the log-prob clamp. Needs only torch,
    megatron-core and the file (its verl imports stand in): `harness repro --script` embeds it."""
    out = losses._VocabParallelKLDivergence.apply(student_logits[None], teacher_topk_log_probs[None],
                                                  teacher_topk_indices[None], None)
    return (out[0] if isinstance(out, tuple) else out)[0]


# `harness repro --script` (the layout with `log_prob_min_clamp`, from 19e2c9d4d on).
if _KL is not None and len(inspect.signature(_KL.forward).parameters) > 4:
    HARNESS = dataclasses.replace(HARNESS, script={
        "name": "verl", "distill": verl_topk_kl, "megatron": True, "how": HOW,
        "files": {"losses": "verl/trainer/distillation/megatron/losses.py"},
        "stubs": {"verl.models.mcore.util": ("preprocess_bshd_engine", "preprocess_thd_engine"),
                  "verl.workers.config": ("DistillationConfig", "DistillationLossConfig")}})
