"""The checkout's root conftest.py acts in this repository's own sessions only. pytest also loads it
in a session of another project that runs the shipped suite from an editable install of this
checkout (`pytest --pyargs harness.conformance`): that session must run as it would without it.

The test starts a pytest of its own, in a project outside the checkout, as `test_plugin.py` does.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

USER_PROJECT = {
    "pytest.ini": "[pytest]\nmarkers =\n    gpu: the project's own marker, for tests it runs anyway\n",
    "conftest.py": "from hypothesis import settings\n\nsettings.register_profile('users', max_examples=7)\n"
                   "settings.load_profile('users')\n",
    "tests/__init__.py": "",
    "tests/test_own.py": (
        "import os\nimport sys\nfrom pathlib import Path\n\nimport pytest\nfrom hypothesis import settings\n\n\n"
        "def test_the_session_is_the_projects_own(request):\n"
        "    import tests\n"
        "    loaded = [name for name, _ in request.config.pluginmanager.list_name_plugin()\n"
        "              if isinstance(name, str) and name.endswith('conftest.py')]\n"
        f"    assert {str(REPO / 'conftest.py')!r} in [os.path.realpath(n) for n in loaded], loaded\n"
        f"    assert {str(REPO)!r} not in [os.path.realpath(p) for p in sys.path], sys.path\n"
        "    assert Path(tests.__file__).parent == Path(__file__).parent\n"
        "    assert settings().max_examples == 7\n\n\n"
        "@pytest.mark.gpu\n"
        "def test_its_own_gpu_marker_is_left_alone():\n"
        "    pass\n"
    ),
}


def _env() -> dict[str, str]:
    """This environment without the checkout on the path: the harness as the install maps it."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CI")}


def test_a_project_running_the_suite_from_an_editable_install_is_left_as_it_is(tmp_path: Path) -> None:
    where = subprocess.run([sys.executable, "-c", "import harness; print(harness.__file__)"], cwd=tmp_path,
                           env=_env(), capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    if Path(where).resolve().parent != REPO / "harness":
        pytest.skip(f"the harness is installed from {where}, not from this checkout: its conftest.py is never reached")
    for name, text in USER_PROJECT.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    # The suite first: its collection loads the checkout's conftest before the project's tests are imported.
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs", "harness.conformance",
                          "tests", "--harness-target", "harness.targets.fused", "-k", "test_the_session or test_its_own",
                          "-rA"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "2 passed" in run.stdout and "SKIPPED" not in run.stdout, run.stdout[-2000:]
