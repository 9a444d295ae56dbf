"""`python -m harness fields`: every case field a spec may set, with its values, from the case classes.

The documentation's tables are generated the same way, not retyped: `python -m harness fields --markdown`.
"""
from __future__ import annotations

import argparse
import dataclasses

from harness.base import levels
from harness.cases.case import field_syntax, fmt_field


def _field_rows(level: str) -> list[tuple[str, str, str]]:
    """(field, what a spec may write, default or "required") for every field of a level's cases."""
    return [(f.name, field_syntax(f), "required" if f.default is dataclasses.MISSING else fmt_field(f.default))
            for f in dataclasses.fields(levels.case_types()[level])]


def fields_markdown() -> str:
    blocks = []
    for level in levels.case_types():
        lines = [f"`{level}:` cases", "", "| field | values | default |", "|---|---|---|"]
        lines += [f"| `{name}` | {values.replace('|', ', ')} | {default} |"
                  for name, values, default in _field_rows(level)]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def fields_plain() -> str:
    blocks = []
    for level in levels.case_types():
        rows = _field_rows(level)
        width = max(len(name) for name, _, _ in rows)
        lines = [f"{level} cases (spec `{level}:field=value,...`)"]
        lines += [f"  {name.ljust(width)}  {values}  ({'required' if default == 'required' else 'default ' + default})"
                  for name, values, default in rows]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def cmd_fields(ns: argparse.Namespace, _cfg: object = None) -> int:
    print(fields_markdown() if ns.markdown else fields_plain())
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fields", help="list the fields of a case spec and the values each takes, per level")
    p.add_argument("--markdown", action="store_true", help="as the markdown tables of the docs")
    p.set_defaults(func=cmd_fields)
