"""``relay="auto"``: the relay mode with the lowest predicted refit time on a topology.

For each candidate mode the cheap passes run (fan-out, senders, routes: seconds at
DeepSeek-V3 scale); the expensive one, rounds, runs only where it could still win. The
routes give a lower bound no schedule can beat: a refit's predicted time is a sum over
rounds of each round's slowest (GPU, link), so it is at least the busiest (GPU, link)'s
total (``Routes.lower_bound``). Candidates are scheduled in order of that bound; once a
mode's prediction is at or below another's bound, that other one is not scheduled.

Candidates are ``none`` and ``domain``. ``chain`` is not one: it plans every replica on
its own (as many transfers as replicas, too many to plan at 256 GPUs in a minute), and
``domain`` does what a chain saves (one copy out of the training pool per NVLink domain,
rings across nodes where the training NICs would bind) with shorter relay runs; it
predicted at or below ``chain`` on every configuration measured
(``tests/test_choice.py``, docs/benchmarks.md). Ask for ``relay="chain"`` to build one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .rounds import Rounds, plan_rounds
from .routes import Routes
from .transfer import LinkModel

CANDIDATES = ("none", "domain")  # in order of preference when predictions tie


@dataclass(frozen=True)
class Candidate:
    """One relay mode: its lower bound and, if scheduled, its predicted time (s)."""

    relay: str
    bound: float
    predicted: float | None = None  # None: not scheduled, its bound could not win

    def __str__(self) -> str:
        if self.predicted is None:
            return f"{self.relay}: not scheduled (its busiest link alone takes {_ms(self.bound)})"
        return f"{self.relay}: predicted {_ms(self.predicted)} (bound {_ms(self.bound)})"


@dataclass(frozen=True)
class RelayChoice:
    """Which relay mode ``relay="auto"`` picked, and every candidate's figures."""

    chosen: str
    candidates: tuple[Candidate, ...]

    @property
    def reason(self) -> str:
        chosen = next(c for c in self.candidates if c.relay == self.chosen)
        others = "; ".join(str(c) for c in self.candidates if c.relay != self.chosen)
        return f"{chosen}; {others}; chain is not a candidate (plan/choice.py)"

    def __str__(self) -> str:
        return f"relay auto -> {self.chosen}: {self.reason}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def choose_relay(
    route: Callable[[str], Routes], bucket_bytes: int, links: LinkModel
) -> tuple[RelayChoice, Routes, Rounds]:
    """The candidate with the lowest predicted time (ties: :data:`CANDIDATES` order),
    its routes and its rounds. ``route(mode)`` runs passes 2-4 for a mode."""
    routed = {mode: route(mode) for mode in CANDIDATES}
    bound = {mode: routed[mode].lower_bound(links) for mode in CANDIDATES}
    best: tuple[float, int, str, Rounds] | None = None
    predicted: dict[str, float] = {}
    for mode in sorted(CANDIDATES, key=lambda m: (bound[m], CANDIDATES.index(m))):
        if best is not None and bound[mode] >= best[0]:
            continue  # no schedule of these routes can beat the best one
        rounds = plan_rounds(routed[mode], bucket_bytes, links)
        assert rounds.seconds is not None  # rounds with a topology carry their prediction
        predicted[mode] = rounds.seconds
        key = (rounds.seconds, CANDIDATES.index(mode))
        if best is None or key < best[:2]:
            best = (*key, mode, rounds)
    assert best is not None
    chosen, rounds = best[2], best[3]
    candidates = tuple(Candidate(m, bound[m], predicted.get(m)) for m in CANDIDATES)
    return RelayChoice(chosen, candidates), routed[chosen], rounds
