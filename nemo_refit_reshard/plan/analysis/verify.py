"""Structural proof that a plan delivers every destination element exactly once.

For each destination tensor, count how many transfers write each element
(numpy masks, so meant for test-sized models): every element covered by a
piece must be written once, padding never. For each transfer, the canonical
box must lie inside a piece its sender holds and inside a piece its receiver
needs, and both local boxes must be that canonical box's image. Bytes delivered
into destination tensors must equal the sum of destination needs.

Carried transfers (``pass4_routes/carry.py``): a leg into a relay buffer must be read from
a piece its sender holds and name a box its final destination needs; it writes
nothing. A leg out of a relay buffer must send exactly what its sender received
into that buffer in the previous round.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ...layouts.base import Box, RankLayout, map_sub_box
from ..base import is_relay, relayed_to
from ..result.refit_plan import RefitPlan


def _containing(pieces, canonical: str, box: Box):
    for p in pieces.get(canonical, ()):
        if p.canonical_box.intersect(box) == box:
            return p
    return None


def verify_plan(plan: RefitPlan, sources: list[RankLayout], destinations: list[RankLayout]) -> None:
    """Raise ``AssertionError`` describing the first violation found."""
    src_pieces = [defaultdict(list) for _ in sources]
    for lay in sources:
        for p in lay.pieces():
            src_pieces[lay.rank][p.canonical].append(p)
    dst_pieces = [defaultdict(list) for _ in destinations]
    for lay in destinations:
        for p in lay.pieces():
            dst_pieces[lay.rank][p.canonical].append(p)
    s = len(sources)
    counts = {
        (s + lay.rank, t.name): np.zeros(t.shape, dtype=np.int32)
        for lay in destinations
        for t in lay.tensors
    }
    delivered = sent = 0
    carried: dict[tuple[int, str, Box], int] = {}  # (rank, relay name, box) -> round received
    for messages in plan.rounds:
        # A relay hop may only forward what its sender received in an earlier round.
        for m in messages:
            for t in m.transfers:
                if t.src >= s and not is_relay(t.src_tensor):
                    have = counts[(t.src, t.src_tensor)][t.src_box.slices()]
                    if not (have == 1).all():
                        raise AssertionError(
                            f"rank {t.src} forwards {t.canonical}{t.canonical_box} in round "
                            f"{m.round} before it has received it"
                        )
        for m in messages:
            for t in m.transfers:
                sent += t.nbytes
                if is_relay(t.src_tensor):
                    if carried.get((t.src, t.src_tensor, t.src_box)) != m.round - 1:
                        raise AssertionError(
                            f"rank {t.src} sends {t.canonical}{t.canonical_box} from its relay "
                            f"buffer in round {m.round} without receiving it in round "
                            f"{m.round - 1}"
                        )
                else:
                    holders = src_pieces[t.src] if t.src < s else dst_pieces[t.src - s]
                    sp = _containing(holders, t.canonical, t.canonical_box)
                    if sp is None or sp.local != t.src_tensor:
                        raise AssertionError(
                            f"source rank {t.src} does not hold {t.canonical}{t.canonical_box}"
                        )
                    if map_sub_box(sp.canonical_box, sp.local_box, t.canonical_box) != t.src_box:
                        raise AssertionError(f"transfer {t} reads the wrong source box")
                final, tensor = relayed_to(t.dst_tensor) or (t.dst, t.dst_tensor)
                dp = _containing(dst_pieces[final - s], t.canonical, t.canonical_box)
                if dp is None or dp.local != tensor:
                    raise AssertionError(
                        f"destination rank {final} does not need {t.canonical}{t.canonical_box}"
                    )
                if map_sub_box(dp.canonical_box, dp.local_box, t.canonical_box) != t.dst_box:
                    raise AssertionError(f"transfer {t} writes the wrong destination box")
                if is_relay(t.dst_tensor):
                    carried[(t.dst, t.dst_tensor, t.dst_box)] = m.round
                    continue
                counts[(t.dst, t.dst_tensor)][t.dst_box.slices()] += 1
                delivered += t.nbytes
    for lay in destinations:
        for tensor in lay.tensors:
            want = np.zeros(tensor.shape, dtype=np.int32)
            for p in tensor.pieces:
                want[p.local_box.slices()] = 1
            got = counts[(s + lay.rank, tensor.name)]
            if not np.array_equal(got, want):
                bad = int(np.sum(got != want))
                raise AssertionError(
                    f"destination rank {lay.rank} {tensor.name}: {bad} elements written "
                    f"{'more than once or never' if bad else ''} (max count {got.max()})"
                )
    if delivered != plan.stats.min_bytes:
        raise AssertionError(
            f"plan delivers {delivered} bytes; destinations need {plan.stats.min_bytes}"
        )
    if sent != plan.stats.total_bytes:
        raise AssertionError(f"plan moves {sent} bytes; its stats say {plan.stats.total_bytes}")
