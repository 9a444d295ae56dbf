"""The all-reduce example of docs/check-your-routine.md, as printed there: `harness check` passes it,
and fails the same routine with an identity backward, with a gradient finding that names the wrong
term of the loss (the entropy's). Run by file path on the session's pools (forked before the file
existed, so the workers resolve it themselves)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[1]
BACKWARD = "        return _all_reduce(grad, dist.ReduceOp.SUM, ctx.group), None\n"
IDENTITY = "        return grad, None\n"


def _documented() -> str:
    doc = (REPO / "docs" / "check-your-routine.md").read_text()
    block = doc.split("<!-- example: my_allreduce_logprobs.py -->\n```python\n", 1)[1]
    return block.split("```", 1)[0]


def _check(path: Path, out: Path, pools) -> tuple[int, list[dict]]:
    code = main(["check", "--target", str(path), "--tp", "2", "--profile", "smoke", "-q", "--json", str(out)],
                pools=pools)
    return code, json.loads(out.read_text())["findings"]


def test_the_documented_all_reduce_routine_passes(tmp_path, harness_pools):
    path = tmp_path / "my_allreduce_logprobs.py"
    path.write_text(_documented())
    code, findings = _check(path, tmp_path / "r.json", harness_pools)
    assert code == 0 and findings == []


def test_an_identity_backward_fails_naming_the_entropy_term(tmp_path, harness_pools, capsys):
    source = _documented()
    assert source.count(BACKWARD) == 1
    path = tmp_path / "my_identity_backward.py"
    path.write_text(source.replace(BACKWARD, IDENTITY))
    code, findings = _check(path, tmp_path / "r.json", harness_pools)
    assert code == 1
    # The log-probs stay right (their reduced values are used alike on every rank): only gradients.
    assert {f["check"] for f in findings} == {"gradients", "tp-invariance"}
    gradients = [f for f in findings if f["check"] == "gradients"]
    for f in gradients:  # shrunk or from the corpus: every reported one says which term is wrong
        assert f["message"].startswith("the entropy term's gradient is wrong: the same case fails with "
                                       "loss_terms=entropy and passes with loss_terms=log_prob"), f["message"]
    printed = capsys.readouterr().out
    assert f"FINDING [gradients] (kernel) {'shrunk' if gradients[-1]['shrunk'] else ''}" in printed
    assert printed.count("start from this one") == (1 if any(f["shrunk"] for f in findings) else 0)
