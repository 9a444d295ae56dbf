"""The core installs without what only reports, plots and benchmarks need; a command that needs a
missing extra names the `pip install` line and exits 2 before doing any work."""
from __future__ import annotations

import sys

import pytest

from harness.cli import main


@pytest.fixture
def no_report_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("jinja2", "matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError


def test_report_without_the_extra_is_refused_before_the_run(no_report_extra, tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["check", "--profile", "smoke", "--report", str(tmp_path / "r.md")])
    assert exit_.value.code == 2
    assert "pip install 'logprob-harness[report]'" in capsys.readouterr().err


def test_trend_without_the_extra_names_the_install_line(no_report_extra, tmp_path, capsys) -> None:
    assert main(["trend", str(tmp_path), "--out", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err
    assert "harness trend needs matplotlib (the `report` extra): pip install 'logprob-harness[report]'" in err
