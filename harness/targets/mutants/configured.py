"""Defects of a trainer's caller in how it applies its own configuration: the chunk size it was
given, the temperature. Wrapper-only targets, as a trainer's loss-side caller is
([docs/peers.md](../../../docs/peers.md#the-trainers-own-callers)): no kernel level stands beside them to compare memory with, so the wrapper's
own memory contract has to see them: `memory-chunk-effect` (the call's memory against its own unchunked
call's) and `memory-logits-dtype` (float32 work held to chunks at a level configured with a chunk size).

A caller that upcasts the whole logits in front of its chunked kernel is `wrapper-logits-float32`
(targets/mutants/memory.py); one that makes the entropy differentiable when `entropy_coef == 0` is
`coef-ignored` (targets/mutants/wrapper.py)."""
from __future__ import annotations

from harness.targets.fused import FusedLogProbEntropy as Fused
from harness.targets.mutants import mutant


@mutant("caller-chunk-size-dropped", "a caller that does not pass its configured chunk size down",
        ("memory-chunk-effect", "memory-logits-dtype"),
        "NeMo-RL: `policy.logprob_chunk_size` configured and not handed to the log-prob call "
        "(#2871/#2872 on the training path)", levels=("wrapper",))
class CallerChunkSizeDropped(Fused):
    def chunk_size(self, args):
        return -1


@mutant("caller-temperature-twice", "a caller that divides by the temperature twice",
        ("temperature",), "a model wrapper and its loss both dividing the logits by the rollout temperature",
        levels=("wrapper",))
class CallerTemperatureTwice(Fused):
    def get_log_probs_and_entropy(self, logits, **kwargs):
        temp = self.temperature(kwargs["args"])
        # The model's output processor divides, then the loss-side call divides again.
        return super().get_log_probs_and_entropy(logits / temp if temp != 1.0 else logits, **kwargs)
