"""NeMo-RL's log-probs at TP x CP on gloo, through the `nemo_rl` and `nemo_rl_unpacked` adapters, against float64.

A standalone check of the adapter's CP mapping that needs none of the harness's CP plumbing: each
world of tp x cp ranks initialises megatron-core's parallel_state with `context_parallel_size`, as
NeMo-RL's Megatron worker does; every rank builds its zigzag rows from one global float32 batch by
its own row map (global row of each local row, or padding), calls the adapter's wrapper and compares
its pieces, and the gradient on its own rows, with float64 autograd on the whole batch.

NeMo-RL's CP backward (`AllGatherCPTensor.backward`) moves an index tensor to CUDA
(`pin_memory=True` then `.cuda()`), so on a CPU-only machine it raises. `--cuda-shim` replaces those
two calls by no-ops in this process, so that the rest of the backward (its all-reduce and re-slice)
can be checked here; without it the script checks the forward and shows the crash.

    PYTHONPATH=$PWD:/path/to/nemo-rl python scripts/studies/nemo_rl_cp.py [--cuda-shim]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from types import SimpleNamespace

import nemo_rl.distributed.model_utils  # noqa: F401  (imported once, before the ranks fork)
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core import parallel_state as mpu

from harness.targets.peers import nemo_rl, nemo_rl_unpacked

ADAPTERS = {"packed": nemo_rl.get_log_probs_and_entropy, "unpacked": nemo_rl_unpacked.get_log_probs_and_entropy}

WORLDS = [(1, 2), (2, 2), (1, 4), (2, 4)]  # (tp, cp)
# (total_lengths, response_lengths, chunk_size, temperature): responses wholly on one chunk, samples
# shorter than 2 * cp, a prompt of length 1, a response of length 0, chunked and not.
CASES = [((9, 5, 12), (4, 2, 7), -1, 1.0),
         ((3, 1, 2), (1, 0, 1), 2, 0.7),
         ((17,), (16,), 3, 1.0),
         ((8, 8), (1, 6), -1, 1.3),
         ((2, 11, 6), (1, 3, 0), 5, 1.0)]
V_LOCAL = 5


def _cuda_shim() -> None:
    """Only for this script: let AllGatherCPTensor.backward's index move stay on the CPU."""
    real_tensor = torch.tensor
    torch.tensor = lambda *a, pin_memory=False, **k: real_tensor(*a, **k)
    torch.Tensor.cuda = lambda self, *a, **k: self


def _global(case, tp: int, seed: int):
    lengths, responses, _, _ = case
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(sum(lengths), tp * V_LOCAL, generator=g) * 3
    tokens = [torch.randint(0, tp * V_LOCAL, (n,), generator=g) for n in lengths]
    weights = [torch.randn(r, generator=g, dtype=torch.float64) for r in responses]
    return logits, tokens, weights


def _reference(logits, tokens, lengths, responses, weights, temperature):
    """float64: log p of every response token and the gradient of sum(w * log p) on every row."""
    x = logits.double().requires_grad_()
    logp = torch.log_softmax(x / temperature, dim=-1)
    per_row = torch.zeros(x.shape[0], dtype=torch.float64)  # log p at response rows, else 0
    w_row = torch.zeros(x.shape[0], dtype=torch.float64)
    offset = 0
    for toks, n, r, w in zip(tokens, lengths, responses, weights, strict=True):
        rows = torch.arange(offset + n - r - 1, offset + n - 1)
        per_row[rows] = logp[rows, toks[n - r:]].detach()
        w_row[rows] = w
        if r:
            (logp[rows, toks[n - r:]] * w).sum().backward(retain_graph=True)
        offset += n
    return per_row, w_row, x.grad if x.grad is not None else torch.zeros_like(x)


def _row_map(lengths, cp: int, cp_rank: int) -> list[int]:
    """Global row of each local row (-1: padding): the load-balanced layout, written as a map."""
    out, offset = [], 0
    for n in lengths:
        padded = n if cp == 1 else -(-n // (2 * cp)) * 2 * cp
        rows = [offset + j if j < n else -1 for j in range(padded)]
        size = padded // (2 * cp) if cp > 1 else padded
        own = (cp_rank, 2 * cp - 1 - cp_rank) if cp > 1 else (0,)
        for c in own:
            out += rows[c * size:(c + 1) * size]
        offset += n
    return out


def _rank(rank: int, tp: int, cp: int, port: int, shim: bool, grad: bool, failures) -> None:
    if shim:
        _cuda_shim()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp * cp, timeout=timedelta(seconds=60))

    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    tp_rank, cp_rank = mpu.get_tensor_model_parallel_rank(), mpu.get_context_parallel_rank()
    for (i, case), (name, wrapper) in ((c, a) for c in enumerate(CASES) for a in ADAPTERS.items()):
        lengths, responses, chunk, temperature = case
        logits, tokens, weights = _global(case, tp, seed=i)
        per_row, w_row, ref_grad = _reference(logits, tokens, lengths, responses, weights, temperature)
        rows = torch.tensor(_row_map(lengths, cp, cp_rank))
        filler = torch.randn(len(rows), V_LOCAL, generator=torch.Generator().manual_seed(100 + rank))
        shard = slice(tp_rank * V_LOCAL, (tp_rank + 1) * V_LOCAL)
        local = torch.where((rows >= 0)[:, None], logits[rows.clamp(min=0), shard], filler)
        leaf = local.clone().requires_grad_(grad)
        args = SimpleNamespace(log_probs_chunk_size=chunk, allgather_cp=False, rollout_temperature=temperature)
        try:
            with torch.set_grad_enabled(grad):
                _, res = wrapper(leaf.unsqueeze(0), args=args, unconcat_tokens=tokens,
                                                   total_lengths=lengths, response_lengths=responses)
            got = torch.cat(res["log_probs"]).double()
            # this rank's expected pieces: its local rows that are response rows, in local order
            mine = rows[rows >= 0]
            mine = mine[_is_response(mine, lengths, responses)]
            err = (got - per_row[mine]).abs().max().item() if got.numel() else 0.0
            msg = f"{name} tp={tp} cp={cp} rank={rank} case={i} grad={grad}: values err {err:.2e}"
            ok = got.shape == per_row[mine].shape and err < 1e-5
            if grad:
                loss = (got.float() * w_row[mine].float()).sum()
                loss.backward()
                expect = torch.where((rows >= 0)[:, None], ref_grad[rows.clamp(min=0), shard], torch.zeros(()))
                gerr = (leaf.grad.double() - expect).abs().max().item() if leaf.numel() else 0.0
                msg += f", grad err {gerr:.2e}"
                ok = ok and gerr < 1e-5
        except Exception as e:  # the crash is the finding; keep the world in step
            ok, msg = False, f"{name} tp={tp} cp={cp} rank={rank} case={i} grad={grad}: {type(e).__name__}: {e}"
        if not ok:
            failures.append(msg)
        print(("ok   " if ok else "FAIL ") + msg, flush=True)
        if not ok and grad:
            break  # a failed collective leaves the world out of step
    dist.destroy_process_group()


def _is_response(rows: torch.Tensor, lengths, responses) -> torch.Tensor:
    keep = torch.zeros(sum(lengths), dtype=torch.bool)
    offset = 0
    for n, r in zip(lengths, responses, strict=True):
        keep[offset + n - r - 1:offset + n - 1] = bool(r)
        offset += n
    return keep[rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuda-shim", action="store_true", help="no-op the CUDA move of NeMo-RL's CP backward")
    opts = ap.parse_args()
    failures = mp.Manager().list()
    start = time.perf_counter()
    for k, (tp, cp) in enumerate(WORLDS):
        for grad in (False, True):
            mp.start_processes(_rank, args=(tp, cp, 29600 + 2 * k + grad, opts.cuda_shim, grad, failures),
                               nprocs=tp * cp, start_method="fork", join=True)
    print(f"{len(failures)} failure(s) in {time.perf_counter() - start:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
