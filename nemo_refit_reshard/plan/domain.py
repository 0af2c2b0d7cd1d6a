"""``relay="domain"``: one copy per NVLink domain per replica group, forwarded inside it.

A replica group (inference ranks holding identical slices) is split into *runs*:
members sharing an NVLink domain. Training ranks send each transfer once per run,
entering at a balanced position of the run, and the run forwards it around, one hop
per round (``plan/expand.py``), so every member's NIC brings in a share and the
training pool sends one copy per domain instead of one per replica.

When the training pool's NICs would still bind (fewer training GPUs than inference
ones, or uneven pipeline stages), :func:`relieve_egress` joins single-member runs of
a group into rings that span nodes: the training ranks send one copy per ring, and
the ring forwards it over the inference GPUs' NICs, whose sending side is idle.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections import defaultdict
from collections.abc import Mapping
from itertools import count
from operator import itemgetter, neg

from .carry import node_groups_of
from .overlap import Need, PlanError
from .relay import node_groups
from .transfer import DTYPE_BYTES, LinkModel, Transfer, new_transfer, sizes_of


def domain_runs(
    groups: list[tuple[int, ...]], links: LinkModel | None
) -> dict[int, list[tuple[int, ...]]]:
    """Runs of ``relay="domain"``: each replica group's members split into runs that
    share an NVLink domain (consecutive members on one node), keyed by the group's
    first member, widest run first (ties in member order). Training ranks send one copy
    per run; the run's members forward it among themselves (:func:`domain_entries`,
    ``plan/expand.py``)."""
    if links is None:
        raise PlanError(
            'relay="domain" needs a topology to know which ranks share an NVLink domain; '
            "pass links=Topology(cluster, placement) (CLI: simulate --cluster ...)"
        )
    out = {}
    for g in groups:
        runs = [tuple(run) for run in node_groups(list(g), links)]
        out[g[0]] = sorted(runs, key=len, reverse=True)  # stable: equal widths keep order
    return out


@functools.lru_cache(maxsize=64)
def entry_weights(widths: tuple[int, ...], units: int = 64) -> list[float]:
    """Share of a group's data to enter at each position ``j`` of its widest run.

    Position ``j`` enters run ``k`` (``widths[k]`` members) at member ``j mod w_k``, so a
    narrower run's members can stand for several positions. Water-filling ``units`` per
    position, each to the position whose busiest entry member stays lowest (then whose
    entry members are least loaded in total), spreads
    every run's share evenly over its members as far as the widths allow (widths 9 and
    7: each of the 7 takes 1/7, the 9 take 1/7 or 1/14)."""
    width = widths[0]
    load = [[0] * w for w in widths]
    weights = [0] * width
    for _ in range(units * width):
        j = min(range(width), key=lambda j: _entry_cost(load, j))
        weights[j] += 1
        for ld in load:
            ld[j % len(ld)] += 1
    return [w / (units * width) for w in weights]


def _entry_cost(load: list[list[int]], j: int) -> tuple[int, int, int]:
    # The busiest entry member first, then the least loaded in total (so members that
    # several positions share do not leave their other positions idle), then order.
    at = [ld[j % len(ld)] for ld in load]
    return max(at), sum(at), j


_SRC, _DST = itemgetter(0), itemgetter(1)  # a transfer's sender and receiver


def domain_entries(
    transfers: list[Transfer], runs_of: dict[int, list[tuple[int, ...]]]
) -> tuple[list[Transfer], dict[int, tuple[int, ...]]]:
    """Where each transfer enters its destination's domains, for ``relay="domain"``.

    ``runs_of[rep]`` are the runs (members sharing an NVLink domain, widest first) of a
    replica group. Transfers to ``rep``, largest first, go to the position ``j`` of the
    widest run furthest below its share (:func:`entry_weights`) and are re-addressed to
    that member; in every other run they enter at member ``j mod width``. So each member
    of a run brings in an even part of its data through its own NIC, and forwards the
    rest around the run (``plan/expand.py``). Returns the re-addressed transfers and,
    per entry member, every run's entry for it (the receivers a sender serves with one
    stored transfer).
    """
    sizes = list(sizes_of(transfers))
    # largest first, then by receiver, sender and position
    keys = zip(map(neg, sizes), map(_DST, transfers), map(_SRC, transfers), count())
    order = [i for _, _, _, i in sorted(keys)]
    total: dict[int, int] = defaultdict(int)
    for t, nbytes in zip(transfers, sizes):
        total[t.dst] += nbytes
    heaps: dict[int, list[tuple[float, int]]] = {}
    for rep, runs in runs_of.items():
        weights = entry_weights(tuple(len(run) for run in runs))
        # (-(share still due), position): the most-behind position first
        heaps[rep] = [(-w * total[rep], j) for j, w in enumerate(weights)]
        heapq.heapify(heaps[rep])
    out = list(transfers)
    for i in order:
        t = transfers[i]
        runs = runs_of.get(t.dst)
        if runs is None:
            continue
        heap = heaps[t.dst]
        due, j = heap[0]
        heapq.heapreplace(heap, (due + sizes[i], j))
        out[i] = new_transfer(Transfer, (t[0], runs[0][j], *t[2:]))  # (``_replace``, cheaper)
    targets = {
        run0[j]: tuple(run[j % len(run)] for run in runs)
        for runs in runs_of.values()
        for run0 in runs[:1]
        for j in range(len(run0))
    }
    return out, targets


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
    NICs (rings of members on different nodes; ``plan/expand.py`` runs them like any
    run). Runs of several members stay as they are: a ring through two NVLink domains
    would push a whole domain's share through one NIC.
    """
    egress: dict[int, float] = defaultdict(float)
    group_bytes: dict[int, int] = defaultdict(int)
    holder_of: dict[int, int] = {}  # a training rank sending to the group
    spb_of: dict[tuple[int, int], float] = {}
    for need in needs:
        runs = runs_of.get(need.dst)
        if runs is None:
            continue
        item = DTYPE_BYTES[dtype_of[(need.dst, need.dst_piece.local)]]
        nbytes = need.canonical_box.numel * item
        group_bytes[need.dst] += nbytes
        holders = need.region.holders
        holder_of.setdefault(need.dst, holders[0].rank)
        share = nbytes / len(holders)
        for h in holders:
            key = (h.rank, need.dst)
            spb = spb_of.get(key)
            if spb is None:
                spb = spb_of[key] = sum(links.link(h.rank, run[0])[1] for run in runs)
            egress[h.rank] += share * spb
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
    spare carry part of it (``carry.choose_ingress_carriers``).
    ``group_bytes[rep]``: bytes one member of ``rep``'s group stores. Returns the
    remaining runs and the members taken out.
    """
    share = {
        m: group_bytes[rep] / len(run) for rep, runs in runs_of.items() for run in runs for m in run
    }
    domains = node_groups_of(sorted(share), links)
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
