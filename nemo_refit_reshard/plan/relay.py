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

from .balance import Transfer

RELAY_MODES = ("none", "chain")


def chain_replicas(transfers: list[Transfer]) -> list[list[Transfer]]:
    """Transfers by hop level: level 0 from training ranks, level k forwarded k times."""
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
        chain = sorted(groups[key], key=lambda t: t.dst)
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
