"""``relay="auto"``: the relay mode with the lowest predicted refit time on a topology.

Each candidate mode has a lower bound on its predicted time that gets tighter, and
dearer, in three stages:

0. *needs* (free): with ``relay="none"`` every byte an inference rank stores comes
   from a training rank, so it takes at least its bytes over the fastest link any
   training rank has into it. (Other modes relay between inference ranks: 0.)
1. *routes* (passes 2-4, seconds at DeepSeek-V3 scale): a refit's predicted time is a
   sum over rounds of each round's slowest (GPU, link), so it is at least the busiest
   (GPU, link)'s total (``Routes.lower_bound``).
2. *rounds* (pass 5, the expensive one): the prediction itself.

Best first: the candidate with the lowest bound is refined one stage, until that
candidate is fully scheduled; every other candidate's bound is then at least its
prediction, so none could win and none is scheduled. Ties go to the earlier of
:data:`CANDIDATES`. A ``domain`` fan-out that forwards nothing (no NVLink domain holds
two members of a replica group, no rings) routes exactly like ``none`` and is merged
into it.

``chain`` is a candidate where its plan stays small: it plans every replica on its own
(one transfer per need and replica), and above :data:`CHAIN_LIMIT` of those (DeepSeek-V3
and Kimi-K2 at 256 GPUs: 9-12 million) it is left out, and the choice says so; ask for
``relay="chain"`` to build it anyway. It has no cheap stage 0 (its first delivery of a
box can enter a node through any member), so it starts at 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from .cluster import LinkModel
from .pass1_needs import Needs
from .pass4_routes import Routes
from .pass5_rounds import Rounds

CANDIDATES = ("none", "domain", "chain")  # in order of preference when predictions tie
CHAIN_LIMIT = 2_000_000  # transfers, one per need and replica, before merging
STAGES = ("needs", "routes", "rounds")


@dataclass(frozen=True)
class Candidate:
    """One relay mode as far as the choice took it: its best bound (``stage`` 0 or 1)
    or its prediction (``stage`` 2), in seconds; ``same_as``: the mode it routes
    exactly like (then not planned on its own)."""

    relay: str
    stage: int
    seconds: float
    same_as: str | None = None
    left_out: str | None = None  # why it is not a candidate here

    def __str__(self) -> str:
        if self.left_out is not None:
            return f"{self.relay}: not a candidate ({self.left_out})"
        if self.same_as is not None:
            return f"{self.relay}: routes exactly like {self.same_as}"
        if self.stage == 2:
            return f"{self.relay}: predicted {_ms(self.seconds)}"
        what = "its busiest link alone takes" if self.stage == 1 else "its needs alone take"
        return f"{self.relay}: not scheduled ({what} {_ms(self.seconds)})"


@dataclass(frozen=True)
class RelayChoice:
    """Which relay mode ``relay="auto"`` picked, and how far each candidate was taken."""

    chosen: str
    candidates: tuple[Candidate, ...]

    @property
    def reason(self) -> str:
        ordered = sorted(self.candidates, key=lambda c: c.relay != self.chosen)
        return "; ".join(str(c) for c in ordered)

    def __str__(self) -> str:
        return f"relay auto -> {self.chosen}: {self.reason}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.6g} ms"


def ingress_bound(needs: Needs, links: LinkModel) -> float:
    """Stage 0 of ``relay="none"``: the largest over inference ranks of (bytes it
    stores) x (seconds per byte of the fastest link from any training rank into it)."""
    worst = 0.0
    for g in needs.groups:
        nbytes = needs.group_bytes(g[0])
        for m in g:
            fastest = min(links.link(s, m)[1] for s in range(needs.num_sources))
            worst = max(worst, nbytes * fastest)
    return worst


def choose_relay(
    needs: Needs,
    route: Callable[[str], Routes],
    schedule: Callable[[Routes], Rounds],
    links: LinkModel,
) -> tuple[RelayChoice, Routes, Rounds]:
    """The candidate with the lowest predicted time (module docstring), its routes and
    its rounds. ``route(mode)`` runs passes 2-4 for a mode, ``schedule(routes)`` pass 5
    (its rounds must carry their predicted ``seconds``)."""
    stage = {mode: 0 for mode in CANDIDATES}
    bound = {"none": ingress_bound(needs, links), "domain": 0.0, "chain": 0.0}
    routed: dict[str, Routes] = {}
    scheduled: dict[str, Rounds] = {}
    same_as: dict[str, str] = {}
    left_out: dict[str, str] = {}
    size = sum(len(needs.by_group[g[0]]) * len(g) for g in needs.groups)
    if size > CHAIN_LIMIT:
        left_out["chain"] = (
            f'{size:,} transfers over every replica, above {CHAIN_LIMIT:,}; relay="chain" builds it'
        )
    direct_members = {g[0]: g for g in needs.groups}
    while True:
        live = [m for m in CANDIDATES if m not in same_as and m not in left_out]
        mode = min(live, key=lambda m: (bound[m], CANDIDATES.index(m)))
        if stage[mode] == 2:
            break
        if stage[mode] == 0:
            routes = routed[mode] = route(mode)
            stage[mode] = 1
            bound[mode] = max(bound[mode], routes.lower_bound(links))
            if mode == "domain" and not routes.chains and routes.members == direct_members:
                # forwards nothing: exactly the ``none`` plan (which keeps its name)
                same_as["domain"] = "none"
                routed["none"] = replace(routes, relay="none")
                stage["none"], bound["none"] = 1, max(bound["none"], bound["domain"])
        else:
            rounds = scheduled[mode] = schedule(routed[mode])
            assert rounds.seconds is not None  # rounds for a topology carry their prediction
            stage[mode], bound[mode] = 2, rounds.seconds
    candidates = tuple(
        Candidate(m, stage[m], bound[m], same_as.get(m), left_out.get(m)) for m in CANDIDATES
    )
    return RelayChoice(mode, candidates), routed[mode], scheduled[mode]
