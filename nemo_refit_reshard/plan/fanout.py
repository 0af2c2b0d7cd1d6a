"""Pass 2, fan-out: how one stored delivery reaches every member of a replica group.

* ``relay="none"``: a sender sends each transfer to every member of the group (the
  plan stores it once, ``replica_groups``); it is charged once per member.
* ``relay="chain"``: every destination is planned on its own, and the routes pass
  chains the replicas that receive the same box from the same sender
  (``plan/relay.py``).
* ``relay="domain"``: the group's members come in *runs* sharing an NVLink domain
  (``plan/domain.py``); a sender sends one copy per run and the run forwards it. Where
  the training NICs would bind, single-member runs join into rings across nodes
  (``relieve_egress``); with ``carry``, members alone in their domain that would bring in
  more than their neighbours become groups of their own (``split_lone_members``), so
  that neighbours can carry part of their copy (``plan/carry.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .domain import domain_runs, relieve_egress, split_lone_members
from .needs import Needs
from .overlap import Need
from .transfer import LinkModel

RELAY_MODES = ("none", "chain", "domain")


@dataclass(frozen=True)
class FanOut:
    """Pass 2's result: the groups planned (stored receiver first), the receivers one
    stored transfer reaches directly (``members``: charged to its sender once each),
    relay runs per group (``relay="domain"``), members planned alone, and the needs the
    senders pass assigns, in group order."""

    relay: str
    groups: tuple[tuple[int, ...], ...]
    members: dict[int, tuple[int, ...]]
    runs_of: dict[int, list[tuple[int, ...]]]
    lone: tuple[int, ...]
    needs: list[Need]

    @property
    def chains(self) -> list[tuple[int, ...]]:
        """Relay runs of more than one member (``relay="domain"``), in group order."""
        return [run for runs in self.runs_of.values() for run in runs if len(run) > 1]

    def __str__(self) -> str:
        copies = sum(len(m) for m in self.members.values())
        return (
            f"FanOut({self.relay}): {len(self.groups)} group(s) planned, {copies} copies "
            f"per stored transfer set, {len(self.chains)} relay run(s), "
            f"{len(self.lone)} lone member(s), {len(self.needs):,} needs"
        )


def plan_fanout(needs: Needs, relay: str, links: LinkModel | None, carry: bool) -> FanOut:
    """Pass 2 (module docstring). ``relay="domain"`` needs ``links``."""
    if relay == "chain":
        groups = [(m,) for g in needs.groups for m in g]
        groups.sort()
        return FanOut(
            relay,
            tuple(groups),
            {g[0]: g for g in groups},
            {},
            (),
            [n for g in groups for n in needs.of(g[0])],
        )
    if relay == "none":
        return FanOut(
            relay,
            needs.groups,
            {g[0]: g for g in needs.groups},
            {},
            (),
            [n for g in needs.groups for n in needs.by_group[g[0]]],
        )
    runs_of = domain_runs(list(needs.groups), links)
    assert links is not None  # domain_runs checked it
    every = [n for g in needs.groups for n in needs.by_group[g[0]]]
    runs_of = relieve_egress(runs_of, every, needs.dtype_of, links)
    groups = list(needs.groups)
    lone: list[int] = []
    if carry:
        sizes = {g[0]: needs.group_bytes(g[0]) for g in needs.groups}
        runs_of, lone = split_lone_members(runs_of, sizes, links)
        if lone:
            for y in lone:
                runs_of[y] = [(y,)]
            groups = [
                (rep, *sorted(m for run in runs for m in run if m != rep))
                for rep, runs in sorted(runs_of.items())
            ]
    return FanOut(
        relay,
        tuple(groups),
        {rep: tuple(run[0] for run in runs) for rep, runs in runs_of.items()},
        runs_of,
        tuple(lone),
        [n for g in groups for n in needs.of(g[0])],
    )
