"""How much to run. A profile sets the randomized case counts of `harness check` and of the
shipped pytest suite (`harness.conformance`), which explores as `check` does.

Nothing here registers or loads a Hypothesis settings profile: the harness's pytest plugin loads into
every session where the package is installed, and the user's own Hypothesis profiles are theirs.
The exploration passes its settings explicitly (`explore_settings`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hypothesis import settings


@dataclass(frozen=True)
class Profile:
    """A run's size. How many randomized cases each level draws per TP size at a profile is the
    level's own (`Level.counts`, by the profile's name); the profile holds the axes every level shares."""
    name: str
    # TP sizes (among those asked for) also explored as subgroups of a world of DP = 2 replicas, as
    # in training, where a reduction over the wrong group gives a wrong answer.
    dp_tp: tuple[int, ...] = ()
    # TP sizes added to those asked for (small cases: the strategies' shapes are small at any size),
    # explored in their own step at `extra_tp_share` of the per-size counts: a TP 8 case costs about
    # six TP 1 cases on 2 cores (docs/performance.md), so an even share would be most of a run.
    extra_tp: tuple[int, ...] = ()
    extra_tp_share: float = 1.0  # of the per-size counts, for each extra TP size
    # Context parallelism (docs/context-parallel.md): the CP sizes of a level that takes CP, and the
    # TP sizes it runs them at (those among the ones asked for, or the smallest asked for).
    cp_sizes: tuple[int, ...] = ()
    cp_tp: tuple[int, ...] = (1, 2)


PROFILES = {
    "smoke": Profile("smoke"),  # CP only when asked for (--cp)
    "ci": Profile("ci", dp_tp=(2,), cp_sizes=(2,)),
    # Sized to finish in under 15 minutes on 2 cores (docs/performance.md has the case counts).
    "thorough": Profile("thorough", dp_tp=(2, 4), extra_tp=(3, 8), extra_tp_share=0.25, cp_sizes=(2, 4)),
}
DEFAULT_PROFILE = "ci"


def explore_settings(max_examples: int, shrink: bool) -> "settings":
    """Settings for an exploration: quiet, no database, no deadline or health checks (a case is a
    distributed run), shrinking optional. Derived from Hypothesis's defaults, not from whatever
    profile the session loaded: a user's profile does not change what the harness draws."""
    from hypothesis import HealthCheck, Phase, Verbosity, settings

    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(settings.get_profile("default"), max_examples=max_examples, derandomize=False, database=None,
                    verbosity=Verbosity.quiet, phases=phases, deadline=None, print_blob=False,
                    report_multiple_bugs=False,
                    # HealthCheck's metaclass iterates its current members (the deprecated ones left out).
                    suppress_health_check=list(HealthCheck))  # pyright: ignore[reportArgumentType]
