"""What a target module declares about itself besides its routines: one typed `HARNESS` attribute.

    from harness.targets.declaration import Declaration

    HARNESS = Declaration(capabilities={"entropy": False}, memory_budget={"retained": 1.0},
                          use=[{"where": {"T": 0}, "why": "trainer/batches.py:12: never empty"}])

- `capabilities`: what the routine does not claim (or, for the opt-in keys, does), each a bool or
  `{device: bool}` (the keys: `harness.targets`, `harness.cases.capabilities`);
- `memory_budget`: retained/peak budgets as multiples of `T * V_local * 4` bytes (docs/memory.md);
- `use`: the inputs the trainer's own callers never make, each entry citing its file and line
  (`harness.checks.use`);
- `script`: how `harness repro --script` calls the routine without the harness (`harness.checks.script`);
- `peer`: where a peer adapter's routine comes from (`harness.targets.peers`).

Every reader asks `declaration_of(module)`. A module written with the loose globals that each
field replaces (`HARNESS_CAPABILITIES`, `HARNESS_MEMORY_BUDGET`, `HARNESS_USE`, `HARNESS_SCRIPT`,
`HARNESS_PEER`) still loads: the same declaration is built from them, and a DeprecationWarning
says so once per module. Where the warning filters turn it into an error (`-W error`, pytest's
`filterwarnings = error`), the line goes to stderr instead: the exception would surface from the
target's loading as a crash of the run, for a form that still works.
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, TypedDict

from harness.base.errors import TargetError

Capability = bool | dict[str, bool]  # one for every device, or per device (`{"cpu": False}`)


class _PeerRequired(TypedDict):
    requires: tuple[str, ...]  # the importable modules it needs ("not installed" without them)
    install: str  # the command that installs them
    upstream: tuple[str, ...]  # the functions adapted, as `package.module.function` (a note may follow)


class PeerInfo(_PeerRequired, total=False):
    """Where a peer adapter's routine comes from (`harness.targets.peers`)."""
    profile: str  # the profile `harness peers` checks it at, when not the default


@dataclass(frozen=True)
class Declaration:
    """A target's declaration; every field is optional, and each keeps the shape of the global it
    replaces."""
    capabilities: dict[str, Capability] = field(default_factory=dict)
    memory_budget: dict[str, float] = field(default_factory=dict)
    use: list[dict[str, Any]] = field(default_factory=list)
    # The keys `files`, `kernel` / `linear` / ..., `megatron`, `how`, `name`, `stubs`, or `none` (why not)
    # (`harness.checks.script`).
    script: dict[str, Any] | None = None
    peer: PeerInfo | None = None


# Each field and the loose module global it replaces.
LEGACY = {"capabilities": "HARNESS_CAPABILITIES", "memory_budget": "HARNESS_MEMORY_BUDGET", "use": "HARNESS_USE",
          "script": "HARNESS_SCRIPT", "peer": "HARNESS_PEER"}
# Namespaces already told about their loose globals, by id; each is kept, so that its id is never
# another's (a SimpleNamespace takes no weak reference).
_told: dict[int, object] = {}


def _name(ns: object) -> str:
    return str(getattr(ns, "__name__", None) or getattr(ns, "__file__", None) or type(ns).__name__)


def declaration_of(ns: ModuleType | Any) -> Declaration:
    """The declaration of a target module or namespace: its `HARNESS`, else one built from the
    loose globals (a DeprecationWarning, once per module), else the empty one. `TargetError` when
    `HARNESS` is not a `Declaration` or comes with a loose global."""
    loose = {f: getattr(ns, g) for f, g in LEGACY.items() if hasattr(ns, g)}
    declared = getattr(ns, "HARNESS", None)
    if declared is not None:
        if not isinstance(declared, Declaration):
            raise TargetError(f"{_name(ns)}.HARNESS is a {type(declared).__name__}, not a "
                              "harness.targets.declaration.Declaration")
        if loose:
            raise TargetError(f"{_name(ns)} declares both HARNESS and {', '.join(LEGACY[f] for f in loose)}: "
                              f"give {', '.join(f'{f}=' for f in loose)} to its Declaration instead")
        return declared
    if loose and id(ns) not in _told:
        _told[id(ns)] = ns
        message = (f"{_name(ns)} declares {', '.join(LEGACY[f] for f in loose)} as module globals, a deprecated "
                   f"form: write HARNESS = Declaration({', '.join(f'{f}=...' for f in loose)}) "
                   "(from harness.targets.declaration) instead")
        try:
            warnings.warn(message, DeprecationWarning, stacklevel=2)
        except DeprecationWarning:
            print(f"DeprecationWarning: {message}", file=sys.stderr)
    return Declaration(capabilities=dict(loose.get("capabilities", {})),
                       memory_budget=dict(loose.get("memory_budget", {})), use=list(loose.get("use", [])),
                       script=loose.get("script"), peer=loose.get("peer"))
