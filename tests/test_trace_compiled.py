"""The collective recorder under torch.compile: a collective inside compiled code (Cut Cross-Entropy's
vocab-parallel path: an all-reduce MAX in a compiled function called from a compiled autograd.Function)
is traced as the collective it wraps, not into the recorder, in a process of its own with a one-rank
gloo group. Dynamo's tables are made before the recorder is installed, as they are in a pool's workers."""
from __future__ import annotations

import subprocess
import sys

PROGRAM = '''
import os, sys, tempfile, torch, torch.distributed as dist
import torch._dynamo.trace_rules as tr; tr.get_torch_obj_rule_map()
from harness.meters import trace; trace.install()
dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "store"), rank=0, world_size=1)
@torch.compile(fullgraph=True, backend="eager")
def reduce(x, pg):
    y = x.clone()
    torch.distributed.all_reduce(y, op=torch.distributed.ReduceOp.MAX, group=pg)
    return y
class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        return reduce(x * 2, pg)
    @staticmethod
    def backward(ctx, g):
        return g * 2, None
@torch.compile(fullgraph=True, backend="eager")
def outer(x, pg):
    return F.apply(x, pg)
with trace.recording() as ev:
    out = outer(torch.ones(3, requires_grad=True), dist.group.WORLD)
    out.sum().backward()
assert torch.equal(out.detach(), torch.full((3,), 2.0)), out
print("ok")
'''


def test_a_collective_inside_compiled_code_runs_under_the_recorder() -> None:
    run = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]
