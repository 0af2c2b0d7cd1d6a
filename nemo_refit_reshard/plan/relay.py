"""Relay fan-out: forward data between inference replicas instead of resending it.

When one training rank sends the same box to R inference ranks (the same slice
of R independent replicas), a direct plan pushes R copies through that
training rank's NIC. ``chain_replicas`` keeps the first delivery and turns the
other R-1 into a chain: replica 1 forwards to replica 2 after it has received,
replica 2 to replica 3, and so on. Every hop moves the same bytes, so each rank
still receives exactly what it stores, and no rank sends more than one copy of
a box. The schedule runs hop ``k`` of a box at least one round after hop
``k-1``; because boxes are many and rounds bounded, hops of different boxes
overlap, which pipelines the chain.
"""

from __future__ import annotations

import functools
import heapq
from collections import defaultdict

from .balance import LinkModel, Transfer, split_box
from .overlap import PlanError

RELAY_MODES = ("none", "chain", "domain")


def _node_groups(dsts: list[int], links: LinkModel | None) -> list[list[int]]:
    """Receivers grouped by node (consecutive ranks sharing NVLink), in rank order."""
    groups: list[list[int]] = []
    for d in dsts:
        if groups and links is not None and links.link(groups[-1][0], d)[0] == "nvlink":
            groups[-1].append(d)
        else:
            groups.append([d])
    return groups


def chain_replicas(
    transfers: list[Transfer], links: LinkModel | None = None
) -> list[list[Transfer]]:
    """Transfers by hop level: level 0 from training ranks, level k forwarded k times.

    With a topology, receivers sharing a node are chained next to each other (the
    hop between them is NVLink) and the box is cut into as many parts as the
    largest node group has members; part j enters every node through that node's
    j-th member, so all of a node's NICs carry an equal share of what enters it.
    """
    groups: dict[tuple, list[Transfer]] = defaultdict(list)
    for t in transfers:
        key = (
            t.src,
            t.src_tensor,
            t.src_box,
            t.dtype,
            t.dst_tensor,
            t.dst_box,
            t.canonical,
            t.canonical_box,
        )
        groups[key].append(t)
    levels: list[list[Transfer]] = [[]]
    for key in sorted(groups, key=lambda k: (k[0], k[1], k[2].offsets, k[4], k[5].offsets)):
        by_dst = {t.dst: t for t in groups[key]}
        nodes = _node_groups(sorted(by_dst), links)
        width = max(len(g) for g in nodes)
        boxes = split_box(key[7], width) if width > 1 else [key[7]]
        for j, box in enumerate(boxes):
            order = [d for g in nodes for d in g[j % len(g) :] + g[: j % len(g)]]
            chain = [by_dst[d].part(box) if len(boxes) > 1 else by_dst[d] for d in order]
            levels[0].append(chain[0])
            for hop in range(1, len(chain)):
                prev, t = chain[hop - 1], chain[hop]
                if len(levels) <= hop:
                    levels.append([])
                levels[hop].append(
                    Transfer(
                        src=prev.dst,
                        dst=t.dst,
                        src_tensor=prev.dst_tensor,
                        src_box=prev.dst_box,
                        dst_tensor=t.dst_tensor,
                        dst_box=t.dst_box,
                        canonical=t.canonical,
                        canonical_box=t.canonical_box,
                        dtype=t.dtype,
                    )
                )
    return levels


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
        runs = [tuple(run) for run in _node_groups(list(g), links)]
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
    order = sorted(
        range(len(transfers)),
        key=lambda i: (-transfers[i].nbytes, transfers[i].dst, transfers[i].src, i),
    )
    total: dict[int, int] = defaultdict(int)
    for t in transfers:
        total[t.dst] += t.nbytes
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
        heapq.heapreplace(heap, (due + t.nbytes, j))
        out[i] = t._replace(dst=runs[0][j])
    targets = {
        run0[j]: tuple(run[j % len(run)] for run in runs)
        for runs in runs_of.values()
        for run0 in runs[:1]
        for j in range(len(run0))
    }
    return out, targets
