"""slime's own routines (THUDM/slime, not part of this repository) give only their known, real
findings (docs/real-routines.md). Skipped unless slime and its `httpx` import are on the path:
`PYTHONPATH=path/to/slime pytest tests/test_slime.py`."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("httpx", reason="slime's modules import httpx")
pytest.importorskip("slime.backends.megatron_utils.loss", reason="slime is not on the path")

from harness.cli import main  # noqa: E402

KNOWN = Path(__file__).resolve().parents[1] / "docs" / "examples" / "slime-known.toml"


@pytest.mark.distributed
def test_slime_has_only_its_known_findings(harness_pools, capsys):
    argv = ["check", "--target", "slime.backends.megatron_utils.loss", "--tp", "1,2", "--profile", "smoke", "-q",
            "--known", str(KNOWN)]
    assert main(argv, pools=harness_pools) == 0, capsys.readouterr().out[-3000:]
    out = capsys.readouterr().out
    assert "STALE" not in out and out.count("KNOWN [") == 2
