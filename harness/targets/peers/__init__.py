"""Adapters for the field's routines: each module maps one peer's functions onto the contract.

An adapter is a target module like any other (`--target harness.targets.peers.NAME`) plus a
`HARNESS_PEER` dict that says where the peer comes from:

- `requires`: the importable modules it needs (the adapter is "not installed" without them);
- `install`: the command that installs them;
- `upstream`: the functions adapted, as `package.module.function`;
- `profile` (optional): the profile `harness peers` checks it at, `ci` unless a peer's own
  sizes make a smaller one enough (the adapter says why).

`NAME.known.toml` next to an adapter lists what the harness finds in that peer (the `--known`
format, docs/known-findings.md), each with its reason; `harness peers` runs the peer with it, so the
matrix tells the explained findings from new ones.

Adapters import their peer lazily, inside the calls, so that every adapter's module (and its
declared capabilities) loads on any machine. They never clone or copy to protect a peer from
itself: where a peer writes into its input, the checks see it. Adding a peer is adding a module
here; `peers()` finds it.
"""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from dataclasses import dataclass
from pathlib import Path

from cases.profiles import DEFAULT_PROFILE
from harness.targets import load_target


@dataclass(frozen=True)
class Peer:
    name: str
    spec: str  # the target spec
    requires: tuple[str, ...]
    install: str
    upstream: tuple[str, ...]
    summary: str  # the module docstring's first paragraph
    cuda_only: bool
    known: Path | None  # NAME.known.toml, when there is one
    profile: str = DEFAULT_PROFILE  # the one `harness peers` checks it at

    def missing(self) -> list[str]:
        """The required modules that are not importable here."""
        out = []
        for mod in self.requires:
            try:
                found = importlib.util.find_spec(mod) is not None
            except (ImportError, ValueError):  # a parent package missing
                found = False
            if not found:
                out.append(mod)
        return out


def peers() -> list[Peer]:
    """Every adapter in this package, in name order."""
    out = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue  # shared helpers, not peers
        spec = f"{__name__}.{info.name}"
        module = importlib.import_module(spec)
        meta = module.HARNESS_PEER
        target = load_target(spec)
        out.append(Peer(info.name, spec, tuple(meta["requires"]), meta["install"], tuple(meta["upstream"]),
                        " ".join((module.__doc__ or "").strip().split("\n\n")[0].split()), not target.supports("cpu"),
                        known if (known := Path(__path__[0]) / f"{info.name}.known.toml").exists() else None,
                        meta.get("profile", DEFAULT_PROFILE)))
    return out
