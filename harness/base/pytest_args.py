"""pytest's rootdir and ini file, chosen as if pytest had known the harness's options from the start.

pytest chooses its rootdir and ini file from the command line's paths before it loads any plugin,
so the value of a plugin's option written apart from its flag (`--harness-known PATH`) is taken for
a path to test (pytest-dev/pytest#8846): a known file inside another repository moves the rootdir
there, and that repository's ini file replaces the user's, `harness_target` included. Once the
plugin is loaded, `restore` chooses them again without those values and, where they differ, puts
pytest's own choice in place: the rootdir, the ini file and its values, the ini's `addopts` and
`pythonpath`, and the confcutdir. (Plugins the other ini's `addopts` disabled with `-p no:NAME`
stay disabled.) Where this pytest keeps its setup elsewhere than `restore` knows, the session is
refused with the form pytest never takes for a path: `--harness-known=PATH`.
"""
from __future__ import annotations

import copy
import inspect
import os
import shlex
import sys
from typing import Any

from harness.base.errors import UsageError


def separate_values(args: list[str], flags: set[str]) -> list[tuple[str, str]]:
    """(flag, value) for each of `flags` whose value is the next argument (not `--flag=value`)."""
    return [(flag, value) for flag, value in zip(args, args[1:], strict=False) if flag in flags and not value.startswith("-")]


def restore(config: Any, parser: Any, args: list[str], flags: set[str]) -> None:
    """In `pytest_load_initial_conftests`, before any conftest loads: the rootdir and ini file
    pytest would have chosen without the values of `flags` taken for paths (`args`, pytest's own
    list, gets the right ini's `addopts`)."""
    given = [*shlex.split(os.environ.get("PYTEST_ADDOPTS", "")), *config.invocation_params.args]
    taken = [(flag, value) for flag, value in separate_values(given, flags) if os.path.exists(value)]
    if not taken:
        return
    ns = parser.parse_known_args(list(given), namespace=copy.copy(config.option))
    try:
        from _pytest.config import findpaths

        wanted = dict(inifile=ns.inifilename, override_ini=getattr(ns, "override_ini", None), args=ns.file_or_dir,
                      rootdir_cmd_arg=ns.rootdir or None, invocation_dir=config.invocation_params.dir)
        params = inspect.signature(findpaths.determine_setup).parameters
        found = findpaths.determine_setup(**{k: v for k, v in wanted.items() if k in params})
        rootpath, inipath, inicfg = found[:3]
        if (rootpath, inipath) == (config.rootpath, config.inipath):
            return
        _replace_setup(config, parser, args, found, ns.confcutdir)
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        flag, value = taken[0]
        raise UsageError(f"pytest took {value} (the value of {flag}) for a path to test and chose its rootdir "
                         f"({config.rootpath}) and ini file ({config.inipath}) from it; write {flag}={value}, "
                         f"which it does not take for a path ({type(e).__name__}: {e})") from None


def _replace_setup(config: Any, parser: Any, args: list[str], found: tuple, confcutdir: str | None) -> None:
    rootpath, inipath, inicfg = found[:3]
    wrong_addopts = list(config.getini("addopts"))
    if args[:len(wrong_addopts)] != wrong_addopts:
        raise ValueError("the other ini file's addopts are not where pytest puts them")
    wrong_paths = [str(p) for p in config.getini("pythonpath")]
    # Private to pytest (checked by the caller's except): what `Config.parse` set from its choice.
    config._rootpath, config._inipath, config._inicfg = rootpath, inipath, inicfg
    if len(found) > 3:
        config._ignored_config_files = found[3]
    config._inicache.clear()
    config._parser.extra_info.update(rootdir=str(rootpath), inifile=str(inipath))
    addopts = list(config.getini("addopts"))
    args[:len(wrong_addopts)] = addopts
    for path in wrong_paths:
        if path in sys.path:
            sys.path.remove(path)
    for path in reversed(config.getini("pythonpath")):
        sys.path.insert(0, str(path))
    config.pluginmanager.consider_preparse(addopts, exclude_only=False)
    config.known_args_namespace = parser.parse_known_args(args, namespace=copy.copy(config.option))
    if confcutdir is None:
        config.known_args_namespace.confcutdir = str(inipath.parent if inipath else rootpath)
