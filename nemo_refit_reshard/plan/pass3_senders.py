"""Pass 3, senders: which training rank sends each needed box (replica choice).

Greedy longest-processing-time assignment: needs in decreasing size go to the holder
whose load stays lowest. Without a topology the load is bytes per sender; with one it
is the predicted busy time of the sender's link (bytes x seconds per byte, per
(sender, link)), so holders on the receiver's node (NVLink) are preferred and NIC load
is spread. A sender is charged once per receiver a stored transfer reaches
(``FanOut.members``). A need larger than the ideal per-sender share ``total / senders``
is first cut along its outermost non-unit dimension into up to ``len(holders)`` parts,
so replicas share one large tensor instead of one replica carrying it whole. Ties break
on rank, so the result is deterministic. Transfers between the same pair of local
tensors whose boxes continue each other are then merged (:func:`coalesce`). What depends
on the needs alone — the transfers whose sender is fixed (:class:`Fixed`) — is built once
and reused when ``relay="auto"`` routes a second relay mode of the same needs.

Colocated (``config.colocation``): a destination's host — the training rank on its GPU —
sends every box it holds (a device-local copy, no interconnect bytes, never split); only
boxes the host lacks are balanced as above.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property, reduce
from itertools import compress
from operator import add, eq, is_, itemgetter, mul

from ..layouts.base import Box, map_sub_box
from .base import DTYPE_BYTES, Transfer, new_transfer, split_box
from .cluster import LinkModel
from .config import PlanConfig
from .pass1_needs import Holder, Need, Needs
from .pass2_fanout import FanOut


@dataclass(frozen=True)
class Senders:
    """Pass 3's result: one transfer per (need part, chosen sender), merged where boxes
    continue each other, addressed to the groups' stored receivers."""

    transfers: list[Transfer]
    # what it took from the needs alone, for another relay mode's pass (``choose_senders``)
    fixed: Fixed | None = field(default=None, repr=False, compare=False)

    def load(self, members: Mapping[int, tuple[int, ...]]) -> dict[int, int]:
        """Bytes each sender sends, counting every receiver a transfer reaches."""
        out: dict[int, int] = defaultdict(int)
        for t in self.transfers:
            out[t.src] += t.nbytes * len(members.get(t.dst, (t.dst,)))
        return dict(out)

    def __str__(self) -> str:
        senders = {t.src for t in self.transfers}
        total = sum(t.nbytes for t in self.transfers)
        return (
            f"Senders: {len(self.transfers):,} transfers from {len(senders)} rank(s), "
            f"{total:,} bytes stored"
        )


def choose_senders(
    needs: Needs, fanout: FanOut, config: PlanConfig, earlier: Senders | None = None
) -> Senders:
    """Pass 3 (module docstring); topology-aware when ``config.links`` is set.
    ``earlier``: this pass's result for another relay mode of the same ``needs``; where
    the fan-out planned the same needs, what it took from them alone (:class:`Fixed`)
    is reused rather than built again."""
    hosts = None
    if config.colocation is not None:
        s = needs.num_sources
        hosts = {s + d: h for d, h in enumerate(config.colocation.hosts)}
    fixed = earlier.fixed if earlier is not None else None
    if fixed is None or not fixed.built_from(fanout.needs, hosts):
        fixed = Fixed.of(fanout.needs, needs.dtype_of, hosts)
    chosen = balance(fixed, config.links, fanout.members)
    return Senders(coalesce(*fixed.merged(chosen)), fixed)


@dataclass(frozen=True)
class Fixed:
    """What the senders pass takes from a needs list alone, whatever the relay mode:
    the transfers whose sender is fixed — a need with one holder, or one whose
    colocated host holds it — in need order, what each fixed sender sends to whom (its
    charges), and the needs with a choice left.

    Each charge is an integer byte count; the load they put on a sender's links
    depends on the fan-out (how many replicas a stored transfer reaches), so it is
    summed per relay mode by :func:`balance`."""

    needs: list[Need]
    hosts: Mapping[int, int] | None
    transfers: list[Transfer]
    charges: dict[int, tuple[list[int], list[int]]]  # sender -> (receivers, bytes)
    open: list[tuple[Need, int, str]]  # (need, its bytes, its wire dtype)
    dst_bytes: dict[int, int]  # bytes each receiver needs in all
    senders: frozenset[int]  # every rank that holds a needed box

    @cached_property
    def ordered(self) -> list[Transfer]:
        """``transfers`` in :func:`coalesce`'s order (a stable sort)."""
        return sorted(self.transfers, key=_PAIR_KEY)

    @cached_property
    def ordered_keys(self) -> list[tuple]:
        return list(map(_PAIR_KEY, self.ordered))

    def merged(self, chosen: list[Transfer]) -> tuple[list[Transfer], list[tuple]]:
        """``sorted(self.transfers + chosen, key=_PAIR_KEY)`` and its keys, without
        sorting the fixed transfers again: each chosen one goes after the fixed ones
        with its key or a smaller one (``bisect_right``: as the stable sort places it,
        ``chosen`` coming last), the chosen in their own stable order."""
        fixed, keys = self.ordered, self.ordered_keys
        placed = sorted(chosen, key=_PAIR_KEY)
        out: list[Transfer] = []
        out_keys: list[tuple] = []
        done = 0
        for t, key in zip(placed, map(_PAIR_KEY, placed)):
            at = bisect_right(keys, key, done)
            out += fixed[done:at]
            out_keys += keys[done:at]
            out.append(t)
            out_keys.append(key)
            done = at
        out += fixed[done:]
        out_keys += keys[done:]
        return out, out_keys

    def built_from(self, needs: list[Need], hosts: Mapping[int, int] | None) -> bool:
        """Whether this is what :meth:`of` makes of ``needs`` (the same objects)."""
        return (
            hosts == self.hosts
            and len(needs) == len(self.needs)
            and all(map(is_, needs, self.needs))
        )

    @classmethod
    def of(
        cls,
        needs: list[Need],
        dtype_of: dict[tuple[int, str], str],
        hosts: Mapping[int, int] | None = None,
    ) -> Fixed:
        """``dtype_of[(dst, local tensor)]``: the destination (wire) dtype; ``hosts[dst]``:
        the source rank on ``dst``'s GPU (colocated), which sends every need it holds."""
        transfers: list[Transfer] = []
        charges: dict[int, tuple[list[int], list[int]]] = {}
        open_needs: list[tuple[Need, int, str]] = []
        dst_bytes: dict[int, int] = defaultdict(int)
        held = list(map(itemgetter(3), needs))  # each need's region
        regions = dict(zip(map(id, held), held)).values()
        senders = frozenset(h.rank for region in regions for h in region.holders)

        def charge(rank: int, dst: int, nbytes: int) -> None:
            to = charges.get(rank)
            if to is None:
                to = charges[rank] = ([], [])
            to[0].append(dst)
            to[1].append(nbytes)

        # Needs come in runs of one receiver: what depends on it alone is looked up per run.
        run_dst = -1
        itemsizes: dict[str, tuple[str, int]] = {}  # its local tensor -> (dtype, bytes each)
        for need in needs:
            dst, dst_piece, box, region = need
            if dst != run_dst:
                run_dst, itemsizes = dst, {}
            local = dst_piece.local
            sized = itemsizes.get(local)
            if sized is None:
                dtype = dtype_of[(dst, local)]
                sized = itemsizes[local] = (dtype, DTYPE_BYTES[dtype])
            dtype, itemsize = sized
            nbytes = box.numel * itemsize
            dst_bytes[dst] += nbytes
            holders = region.holders
            if len(holders) > 1:
                host = hosts.get(dst) if hosts else None
                mine = [h for h in holders if h.rank == host] if host is not None else []
                if mine:  # colocated: a same-GPU copy costs no interconnect bytes
                    transfers.append(_transfer(mine[0], need, box, dtype))
                    charge(host, dst, nbytes)
                else:
                    open_needs.append((need, nbytes, dtype))
                continue
            # ``charge`` and ``_transfer`` inlined: this loop runs over every expert slice.
            rank, src_piece = holders[0].rank, holders[0].piece
            to = charges.get(rank)
            if to is None:
                to = charges[rank] = ([], [])
            to[0].append(dst)
            to[1].append(nbytes)
            cb = dst_piece.canonical_box
            # (``map_sub_box``'s first case inlined: a source piece stored as its
            # canonical box, as most expert weights are, maps a box to itself)
            sc, sl = src_piece.canonical_box, src_piece.local_box
            same = sc is sl or (sc.offsets == sl.offsets and sc.sizes == sl.sizes)
            transfers.append(
                new_transfer(
                    Transfer,
                    (
                        rank,
                        dst,
                        src_piece.local,
                        box if same else map_sub_box(sc, sl, box),
                        local,
                        dst_piece.local_box
                        if box is cb
                        else map_sub_box(cb, dst_piece.local_box, box),
                        dst_piece.canonical,
                        box,
                        dtype,
                    ),
                )
            )
        return cls(needs, hosts, transfers, charges, open_needs, dict(dst_bytes), senders)


def _transfer(holder: Holder, need: Need, box: Box, dtype: str) -> Transfer:
    """``box`` of ``need`` (inside its canonical box) sent by ``holder``."""
    src_piece, dst_piece = holder.piece, need.dst_piece
    return Transfer(
        holder.rank,
        need.dst,
        src_piece.local,
        src_piece.local_sub_box(box),
        dst_piece.local,
        dst_piece.local_sub_box(box),
        dst_piece.canonical,
        box,
        dtype,
    )


def balance(
    fixed: Fixed,
    links: LinkModel | None = None,
    members: Mapping[int, tuple[int, ...]] | None = None,
) -> list[Transfer]:
    """The transfers of ``fixed.open``'s needs, each with the sender chosen by the greedy
    of the module docstring, after charging every fixed transfer.

    Without ``links`` the balancer minimises the largest number of bytes one sender
    sends. With ``links`` it minimises the largest predicted busy time of a sender's
    link — bytes × seconds-per-byte, per (sender, link) — so holders on the receiver's
    node (NVLink) are preferred and NIC load is spread. ``members[dst]``: the replicas
    ``dst`` stands for (itself first), each charged.
    """
    members = members or {}

    def copies(dst: int) -> int:
        return len(members.get(dst, (dst,)))

    busy: dict[tuple[int, str], float] = defaultdict(float)  # (sender, link) -> busy seconds
    weights: dict[tuple[int, int], list[tuple[tuple[int, str], float]]] = {}

    def weight(rank: int, dst: int) -> list[tuple[tuple[int, str], float]]:
        """(sender link, cost per byte) of sending one byte to ``dst`` and its replicas."""
        w = weights.get((rank, dst))
        if w is None:
            acc: dict[tuple[int, str], float] = defaultdict(float)
            for d in members.get(dst, (dst,)):
                if links is None:
                    acc[(rank, "")] += 1.0
                else:
                    link, seconds_per_byte = links.link(rank, d)
                    acc[(rank, link)] += seconds_per_byte
            w = weights[(rank, dst)] = sorted(acc.items())
        return w

    # The fixed transfers first, so the greedy choice for the others sees every fixed
    # load (experts held by one EP rank are most of a DeepSeek-V3 plan). Each link's
    # load is summed in need order, one product per charge, as charging them one by one
    # would (a charge on another link adds 0.0, which changes no sum): the same floats.
    for rank, (dsts, sizes) in fixed.charges.items():
        per_dst = {d: dict(weight(rank, d)) for d in dict.fromkeys(dsts)}
        for k in sorted({k for w in per_dst.values() for k in w}):
            cost = {d: w.get(k, 0.0) for d, w in per_dst.items()}
            busy[k] = reduce(add, map(mul, sizes, map(cost.__getitem__, dsts)), busy[k])
    total = sum(n * copies(d) for d, n in fixed.dst_bytes.items())
    share = max(1, total // max(1, len(fixed.senders)))
    items: list[tuple[int, int, Need, Box, str]] = []
    for index, (need, nbytes, dtype) in enumerate(fixed.open):
        wire = nbytes * copies(need.dst)
        parts = 1
        if wire > share:
            parts = min(len(need.region.holders), -(-wire // share))
        if parts == 1:
            items.append((nbytes, index, need, need.canonical_box, dtype))
            continue
        for box in split_box(need.canonical_box, parts):
            items.append((box.numel * nbytes // max(1, need.numel), index, need, box, dtype))
    # Largest first; index keeps the order total for equal sizes.
    items.sort(key=lambda it: (-it[0], it[1], it[3].offsets))
    out: list[Transfer] = []
    known = weights.get
    for nbytes, _, need, box, dtype in items:
        dst = need.dst
        best = None
        for h in need.region.holders:
            rank = h.rank
            w = known((rank, dst)) or weight(rank, dst)
            if len(w) == 1:  # one link (a max over one term, written out)
                ((k, c),) = w
                score = busy[k] + nbytes * c
            else:
                score = max(busy[k] + nbytes * c for k, c in w)
            if best is None or (score, rank) < best[0]:
                best = ((score, rank), h)
        assert best is not None
        holder = best[1]
        for k, c in weight(holder.rank, dst):
            busy[k] += nbytes * c
        out.append(_transfer(holder, need, box, dtype))
    return out


def coalesce(transfers: list[Transfer], keys: list[tuple] | None = None) -> list[Transfer]:
    """Merge adjacent transfers between the same (src tensor, dst tensor) pair.

    Sorted by (src, dst, src tensor, dst tensor, canonical, dtype), then by source
    box; where consecutive transfers share that key and their boxes continue each
    other (:meth:`Box.followed_by`), they become one. ``keys`` given, ``transfers``
    are in that order already and ``keys`` are theirs (:meth:`Fixed.merged`)."""
    if keys is None:
        ordered = sorted(transfers, key=_PAIR_KEY)
        keys = list(map(_PAIR_KEY, ordered))
    else:
        ordered = transfers
    # Most keys are unique (one slice of one expert): find the runs of equal ones in C.
    starts = list(compress(range(1, len(keys)), map(eq, keys, keys[1:])))
    if not starts:
        return ordered
    out: list[Transfer] = []
    done = 0
    i = 0
    while i < len(starts):
        lo = starts[i] - 1  # the run starts one before its first repeat
        hi = starts[i] + 1
        i += 1
        while i < len(starts) and starts[i] == hi:
            hi += 1
            i += 1
        out.extend(ordered[done:lo])
        out.extend(_merge_run(sorted(ordered[lo:hi], key=lambda t: t.src_box.offsets)))
        done = hi
    out.extend(ordered[done:])
    return out


# (src, dst, src_tensor, dst_tensor, canonical, dtype): transfers that may merge
_PAIR_KEY = itemgetter(0, 1, 2, 4, 6, 8)


def _merge_run(run: list[Transfer]) -> list[Transfer]:
    """Transfers of one key in source-box order, merged where each continues the last."""
    out: list[Transfer] = []
    current = run[0]
    for t in run[1:]:
        src_box = current.src_box.followed_by(t.src_box)
        dst_box = current.dst_box.followed_by(t.dst_box)
        canonical_box = current.canonical_box.followed_by(t.canonical_box)
        if src_box and dst_box and canonical_box:
            current = Transfer(
                current.src,
                current.dst,
                current.src_tensor,
                src_box,
                current.dst_tensor,
                dst_box,
                current.canonical,
                canonical_box,
                current.dtype,
            )
        else:
            out.append(current)
            current = t
    out.append(current)
    return out
