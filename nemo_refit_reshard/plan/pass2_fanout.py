"""Pass 2, fan-out: how one stored delivery reaches every member of a replica group.

* ``relay="none"``: a sender sends each transfer to every member of the group (the
  plan stores it once, ``replica_groups``); it is charged once per member.
* colocated (``config.colocation``): every destination is planned on its own, with no
  relays: replicas on different GPUs have different hosts, so they share no message.
* ``relay="chain"``: every destination is planned on its own, and the routes pass
  chains the replicas that receive the same box from the same sender
  (``pass4_routes/chain.py``).
* ``relay="domain"``: the group's members come in *runs* sharing an NVLink domain
  (:func:`domain_runs`); a sender sends one copy per run and the run forwards it
  (``pass4_routes/domain.py``). Where the training NICs would bind, single-member runs
  join into rings across nodes (:func:`relieve_egress`): the training ranks send one
  copy per ring, and the ring forwards it over the inference GPUs' NICs, whose sending
  side is idle. With ``carry``, members alone in their domain that would bring in more
  than their neighbours become groups of their own (:func:`split_lone_members`), so
  that neighbours can carry part of their copy (``pass4_routes/carry.py``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from .base import DTYPE_BYTES, PlanError
from .cluster import LinkModel, nvlink_domains
from .config import PlanConfig
from .pass1_needs import Need, Needs


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


def plan_fanout(needs: Needs, config: PlanConfig) -> FanOut:
    """Pass 2 (module docstring) for ``config.mode``; ``relay="domain"`` needs
    ``config.links``."""
    relay, links = config.mode, config.links
    if relay == "chain" or config.colocation is not None:
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
    if config.carry:
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


def domain_runs(
    groups: list[tuple[int, ...]], links: LinkModel | None
) -> dict[int, list[tuple[int, ...]]]:
    """Runs of ``relay="domain"``: each replica group's members split into runs that
    share an NVLink domain (consecutive members on one node), keyed by the group's
    first member, widest run first (ties in member order). Training ranks send one copy
    per run; the run's members forward it among themselves (:func:`domain_entries`,
    ``result/expand.py``)."""
    if links is None:
        raise PlanError(
            'relay="domain" needs a topology to know which ranks share an NVLink domain; '
            "pass links=Topology(cluster, placement) (CLI: simulate --cluster ...)"
        )
    out = {}
    for g in groups:
        runs = [tuple(run) for run in nvlink_domains(g, links, contiguous=True)]
        out[g[0]] = sorted(runs, key=len, reverse=True)  # stable: equal widths keep order
    return out


def relieve_egress(
    runs_of: dict[int, list[tuple[int, ...]]],
    needs: list[Need],
    dtype_of: dict[tuple[int, str], str],
    links: LinkModel,
    margin: float = 0.02,
    worth: float = 0.03,
) -> dict[int, list[tuple[int, ...]]]:
    """Fewer copies out of the training pool when its NICs would bind, not the inference
    GPUs' own.

    Estimates, in link seconds: ``E``, the busiest training rank's egress (a need with
    one holder charged to it, one with several split evenly, times the runs of its
    group), and ``I``, the busiest inference rank's ingress (its group's bytes over the
    width of its run). If ``E > (1 + worth) I`` (below that, the ring's extra round of
    forwarding costs about what it saves), every group's single-member runs are joined into
    rings so the group has ``floor(c * (1 - margin) * I / E)`` runs instead of ``c``
    (never fewer than its multi-member runs plus one): the training ranks then send
    ``E`` down to about ``I``, and each ring forwards what enters it over its members'
    NICs (rings of members on different nodes; ``result/expand.py`` runs them like any
    run). Runs of several members stay as they are: a ring through two NVLink domains
    would push a whole domain's share through one NIC.
    """
    egress: dict[int, float] = defaultdict(float)
    group_bytes: dict[int, int] = defaultdict(int)
    holder_of: dict[int, int] = {}  # a training rank sending to the group
    # Needs come in runs of one receiver: what depends on it alone is looked up per run.
    run_dst, runs = -1, None
    itemsizes: dict[str, int] = {}  # its local tensor -> bytes per element
    spb_of: dict[int, float] = {}  # sender -> seconds per byte to every run of the group
    for dst, dst_piece, box, region in needs:
        if dst != run_dst:
            run_dst, runs, itemsizes, spb_of = dst, runs_of.get(dst), {}, {}
        if runs is None:
            continue
        local = dst_piece.local
        item = itemsizes.get(local)
        if item is None:
            item = itemsizes[local] = DTYPE_BYTES[dtype_of[(dst, local)]]
        nbytes = box.numel * item
        group_bytes[dst] += nbytes
        holders = region.holders
        if dst not in holder_of:
            holder_of[dst] = holders[0].rank
        share = nbytes / len(holders)
        for h in holders:
            rank = h.rank
            spb = spb_of.get(rank)
            if spb is None:
                spb = spb_of[rank] = sum(links.link(rank, run[0])[1] for run in runs)
            egress[rank] += share * spb
    if not egress:
        return runs_of
    # A run's members bring in its copy in even shares, each through its own link.
    ingress = max(
        group_bytes[rep] / len(run) * links.link(holder_of[rep], run[0])[1]
        for rep, runs in runs_of.items()
        if rep in group_bytes
        for run in runs
    )
    busiest = max(egress.values())
    if busiest <= ingress * (1 + worth):
        return runs_of
    out = {}
    for rep, runs in runs_of.items():
        singles = [run[0] for run in runs if len(run) == 1]
        wide = [run for run in runs if len(run) > 1]
        target = max(len(wide) + 1, math.floor(len(runs) * (1 - margin) * ingress / busiest))
        rings = target - len(wide)
        if len(singles) < 2 or rings >= len(singles):
            out[rep] = runs
            continue
        # ``rings`` rings of near-equal size, members in group order.
        joined = [
            tuple(singles[k * len(singles) // rings : (k + 1) * len(singles) // rings])
            for k in range(rings)
        ]
        out[rep] = sorted(wide + joined, key=len, reverse=True)
    return out


def split_lone_members(
    runs_of: dict[int, list[tuple[int, ...]]],
    group_bytes: Mapping[int, int],
    links: LinkModel,
    worth: float = 0.03,
) -> tuple[dict[int, list[tuple[int, ...]]], list[int]]:
    """Single-member runs that would bring in more than their NVLink domain's mean,
    taken out of their groups to be planned on their own.

    A member alone in its domain takes its group's whole copy through its own NIC,
    while members of wider runs there take a share. Planned as its own group (still
    one copy from the training pool), it can have domain neighbours with NIC time to
    spare carry part of it (``pass4_routes/carry.py``).
    ``group_bytes[rep]``: bytes one member of ``rep``'s group stores. Returns the
    remaining runs and the members taken out.
    """
    share = {
        m: group_bytes[rep] / len(run) for rep, runs in runs_of.items() for run in runs for m in run
    }
    domains = nvlink_domains(sorted(share), links)
    mean = {m: sum(share[x] for x in d) / len(d) for d in domains for m in d}
    alone = {
        run[0]
        for runs in runs_of.values()
        if len(runs) > 1
        for run in runs
        if len(run) == 1 and share[run[0]] > mean[run[0]] * (1 + worth)
    }
    if not alone:
        return runs_of, []
    out = {}
    for rep, runs in runs_of.items():
        kept = [run for run in runs if run[0] not in alone or len(run) > 1]
        if kept and kept[0][0] != rep and rep in alone:
            # the group's stored receiver moves to the first member still in it
            out[kept[0][0]] = kept
        elif kept:
            out[rep] = kept
    return out, sorted(alone)
