"""Two environments used alternately build the C++ memory ledger once each, and never again.

Makes two virtual environments under a scratch directory, each seeing this interpreter's packages
(torch included) through a .pth file, so each has a prefix of its own and nothing is installed.
Then loads the ledger in A, B, A, B, ... and reports for each run whether it built and how long it
took; exits 1 if an environment built more than once (from an empty scratch directory each builds
exactly once, in its first round; run again on the same scratch, none builds). Run from the
repository root:

    python scripts/studies/ledger_envs.py --scratch SCRATCH_DIR --rounds 3
"""
from __future__ import annotations

import argparse
import os
import site
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = "from harness.meters import ledger_build, memory_meter; print(memory_meter.ledger_name(), ledger_build.extension_name())"


def make_env(path: Path) -> Path:
    if not (path / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "shared-packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scratch", type=Path, required=True, help="where the environments and the build cache go")
    parser.add_argument("--rounds", type=int, default=3)
    ns = parser.parse_args()
    envs = {name: make_env(ns.scratch / f"env-{name}") for name in "AB"}
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": str(ns.scratch / "torch_extensions")}
    env.pop("HARNESS_LEDGER", None)
    builds = {name: 0 for name in envs}
    for round_ in range(ns.rounds):
        for name, python in envs.items():
            start = time.perf_counter()
            run = subprocess.run([python, "-c", PROBE], env=env, capture_output=True, text=True, check=False)
            built = "building the C++ memory ledger" in run.stderr
            builds[name] += built
            print(f"round {round_ + 1} env {name}: {run.stdout.strip()} {'BUILT' if built else 'cached'} "
                  f"in {time.perf_counter() - start:.1f}s" + (f" rc={run.returncode} {run.stderr[-500:]}" if run.returncode else ""),
                  flush=True)
    print(f"builds per environment: {builds}")
    return 0 if all(n <= 1 for n in builds.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
