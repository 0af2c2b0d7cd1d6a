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

from collections import defaultdict
from dataclasses import replace

from .balance import LinkModel, Transfer, split_box
from .overlap import PlanError
from .schedule import Message

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


def domain_chains(
    groups: list[tuple[int, ...]], links: LinkModel | None
) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Entries and forwarding chains of ``relay="domain"``.

    Each replica group's members are split into runs that share an NVLink domain
    (consecutive members on one node). The first member of each run is an *entry*:
    training ranks send to it directly, once per domain instead of once per
    replica. The others receive along a chain inside the domain, one hop per
    round: the k-th member gets, k rounds later, exactly what the entry got. The
    plan stores only the entries' messages; chains are expanded on demand, so
    this scales like a direct plan (DeepSeek-V3 on 256 GPUs) while removing the
    replica factor from the training NICs wherever replicas share a domain.
    Returns (entry groups, first entry first; chains, entry first).
    """
    if links is None:
        raise PlanError(
            'relay="domain" needs a topology to know which ranks share an NVLink domain; '
            "pass links=Topology(cluster, placement) (CLI: simulate --cluster ...)"
        )
    entries, chains = [], []
    for g in groups:
        runs = _node_groups(list(g), links)
        entries.append(tuple(run[0] for run in runs))
        chains += [tuple(run) for run in runs if len(run) > 1]
    return entries, chains


def spread_entries(rounds: list[list[Message]], width_of: dict[int, int]) -> list[list[Message]]:
    """Entry positions for ``relay="domain"``: per round and receiver group, messages
    go largest first to the least-loaded of its ``width`` positions, so each member
    of a run brings in about ``1/width`` of what enters the run through its own NIC
    (``plan/expand.py`` forwards the rest around the run)."""
    out = []
    for msgs in rounds:
        load: dict[int, list[int]] = {}
        entry: dict[int, int] = {}
        for i in sorted(range(len(msgs)), key=lambda i: (-msgs[i].nbytes, msgs[i].src)):
            m = msgs[i]
            width = width_of.get(m.dst, 1)
            if width == 1:
                continue
            used = load.setdefault(m.dst, [0] * width)
            j = min(range(width), key=lambda x: (used[x], x))
            used[j] += m.nbytes
            entry[i] = j
        out.append([replace(m, entry=entry[i]) if i in entry else m for i, m in enumerate(msgs)])
    return out
