"""What each peer adapter really imports, beyond torch and megatron-core: docs/peers.md's table of
each peer's dependencies. Each adapter is imported in a fresh process with the trees on PYTHONPATH
(an adapter of a source tree loads its peer's files when it is imported); the packages loaded then,
less what the harness, torch and megatron-core load themselves, are the peer's. An adapter of an
installed package (verl, TRL, Cut Cross-Entropy, Liger) imports it at its first call instead: what
that package needs is what its install line brings.

    PYTHONPATH=.:$NEMO_RL:$MS_SWIFT:$SKYRL python scripts/studies/peer_dependencies.py
"""
from __future__ import annotations

import json
import subprocess
import sys

from harness.targets.peers import peers

PROBE = r"""
import importlib, json, sys, warnings
warnings.simplefilter("ignore")
import torch, harness.targets, harness.engine.executor, harness.levels
try:
    import megatron.core.parallel_state, megatron.core.tensor_parallel
except ImportError:
    pass
base = set(sys.modules)
try:
    importlib.import_module(sys.argv[1])
    error = ""
except Exception as e:  # noqa: BLE001 - what is missing is the answer
    error = f"{type(e).__name__}: {e}"
new = {n.split(".")[0] for n in set(sys.modules) - base}
std = set(sys.stdlib_module_names)
print(json.dumps({"error": error, "packages": sorted(n for n in new if n not in std and not n.startswith("_")
                                                    and n not in ("harness", "cases", "reference"))}))
"""


def main() -> int:
    print("| peer | packages loaded with its files, beyond torch and megatron-core | how to get it |\n|---|---|---|")
    for peer in sorted(peers(), key=lambda p: p.name):
        name = peer.name
        out = subprocess.run([sys.executable, "-c", PROBE, peer.spec], capture_output=True, text=True, check=False)
        try:
            got = json.loads(out.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            got = {"error": (out.stderr.strip().splitlines() or ["no output"])[-1], "packages": []}
        loaded = ", ".join(p for p in got["packages"] if p not in ("triton", "cython_runtime")) or "none"
        why = f" (not importable here: {got['error']})" if got["error"] else ""
        print(f"| {name} | {loaded}{why} | {peer.install} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
