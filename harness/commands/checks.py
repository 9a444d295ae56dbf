"""`python -m harness checks`: what every registered check asserts, listed from the registry itself.

The docstring of a check is its definition: this lists them (with the levels it runs at, the
smallest TP size at which it can fail, and the catalog mutants it is meant to catch), so the
documentation's table is generated, not retyped: `python -m harness checks --markdown`.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

from harness.checks import Check, all_checks


def _one_line(doc: str) -> str:
    return " ".join(doc.split())


def _mutants_by_check() -> dict[str, list[str]]:
    from harness.targets.mutants import catalog

    out: dict[str, list[str]] = defaultdict(list)
    for m in catalog().values():
        for name in m.expected:
            out[name].append(m.name)
    return out


def _rows() -> list[tuple[Check, list[str]]]:
    mutants = _mutants_by_check()
    return [(chk, mutants.get(name, [])) for name, chk in all_checks(bitwise=True).items()]


def _opt_in(chk: Check) -> str:
    return " (opt-in: `--bitwise`)" if chk.family == "bitwise" else ""


def markdown() -> str:
    lines = ["| check | levels | min ranks (TP x CP) | what it asserts | catalog mutants it catches |",
             "|---|---|---|---|---|"]
    for chk, mutants in _rows():
        caught = ", ".join(f"`{m}`" for m in mutants) or "-"
        lines.append(f"| `{chk.name}`{_opt_in(chk)} | {', '.join(chk.levels)} | {chk.min_ranks} | "
                     f"{_one_line(chk.doc).replace('|', '&#124;')} | {caught} |")
    return "\n".join(lines)


def plain() -> str:
    blocks = []
    for chk, mutants in _rows():
        head = f"{chk.name}  [{', '.join(chk.levels)}; TP x CP >= {chk.min_ranks}]{_opt_in(chk).replace('`', '')}"
        body = f"    {_one_line(chk.doc)}"
        if mutants:
            body += f"\n    catches: {', '.join(mutants)}"
        blocks.append(f"{head}\n{body}")
    return "\n\n".join(blocks)


def cmd_checks(ns: argparse.Namespace, _cfg: object = None) -> int:
    print(markdown() if ns.markdown else plain())
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checks", help="list the registered checks and what each asserts")
    p.add_argument("--markdown", action="store_true", help="as the markdown table of the docs")
    p.set_defaults(func=cmd_checks)
