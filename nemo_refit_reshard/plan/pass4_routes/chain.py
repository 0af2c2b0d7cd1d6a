"""``relay="chain"`` routes: forward data between inference replicas instead of resending it.

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

from ..base import Transfer, split_box
from ..cluster import LinkModel, nvlink_domains


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
        receivers = sorted(by_dst)
        nodes = (
            [[d] for d in receivers]
            if links is None
            else nvlink_domains(receivers, links, contiguous=True)
        )
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
