"""The parts first-fit rounds (``first_fit.py``) place: transfers cut to what one round
holds (:func:`cut`), grouped by the source box they read (:func:`fan_out_groups`: a
fan-out goes in one round whole), and the senders' groups taken in turn
(:func:`interleave`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from ...layouts.base import Box
from ..base import Transfer, split_box


def _lead_dim(box: Box) -> int | None:
    """The first dim of ``box`` longer than 1 (parts are cut along it), if any."""
    for d, s in enumerate(box.sizes):
        if s != 1:
            return d
    return None


def cut(t: Transfer, max_bytes: int, bucket_bytes: int) -> list[Transfer]:
    """Cut a transfer into parts of at most ``max_bytes`` along the lead canonical dim.

    ``max_bytes`` may be below the bucket (what the slowest link moves in a round's time
    budget, when ``first_fit.schedule`` has ``links``); a single row larger
    than it stays whole, but a row larger than the bucket is an error."""
    if t.nbytes <= max_bytes:
        return [t]
    parts = -(-t.nbytes // max_bytes)
    lead = _lead_dim(t.canonical_box)
    if lead is None:
        return [t]
    rows = t.canonical_box.sizes[lead]
    if rows < parts:
        if -(-t.nbytes // rows) > bucket_bytes:
            raise ValueError(
                f"bucket of {bucket_bytes} bytes cannot hold one row of {t.canonical} "
                f"({t.nbytes // rows} bytes); raise bucket_mb"
            )
        parts = rows
    return [t.part(box) for box in split_box(t.canonical_box, parts)]


def fan_out_groups(
    transfers: list[Transfer], cut_bytes: Callable[[Transfer], int], bucket_bytes: int
) -> list[list[Transfer]]:
    """Bucket-sized parts, grouped by the source box they read.

    Parts reading the same source box (one slice for several inference replicas) form
    a fan-out group that goes into one round whole: the replicas' messages then hold
    the same boxes in the same order, and the engine packs them once. The sender is
    still charged per message, so the bucket bound holds even when nothing is shared.
    Groups bound for the same receivers sit next to each other, so a round serves few
    receivers with large messages rather than every receiver with a small one.
    """
    by_box: dict[tuple, list[Transfer]] = {}
    for t in transfers:
        for p in cut(t, cut_bytes(t), bucket_bytes):
            key = (p.src, p.src_tensor, p.src_box.offsets, p.src_box.sizes, p.dtype)
            group = by_box.get(key)
            if group is None:
                by_box[key] = [p]
            else:
                group.append(p)
    groups = list(by_box.values())
    for g in groups:
        if len(g) > 1:
            g.sort(key=lambda t: (t.dst, t.dst_tensor, t.dst_box.offsets))
    # Stable sort: groups with equal keys keep the (deterministic) order of ``transfers``.
    groups.sort(key=lambda g: (g[0].src, tuple(t.dst for t in g)))
    return groups


def interleave(groups: list[list[Transfer]]) -> list[list[Transfer]]:
    """Take the senders' groups in turn, each sender starting at a different receiver.

    First-fit placement in sender order would give the first senders the early
    rounds and leave the last ones a tail of late rounds (their receivers' early
    rounds already full): rounds then run far below the busiest sender's link.
    Taking one group per sender in turn fills every round from every sender;
    rotating each sender's list by its index spreads their first receivers.
    """
    by_src: dict[int, list[list[Transfer]]] = defaultdict(list)
    for g in groups:
        by_src[g[0].src].append(g)
    queues = []
    for i, src in enumerate(sorted(by_src)):
        gs = by_src[src]
        k = i * len(gs) // len(by_src)
        queues.append(gs[k:] + gs[:k])
    out = []
    for depth in range(max((len(q) for q in queues), default=0)):
        out += [q[depth] for q in queues if depth < len(q)]
    return out
