"""The gather-broadcast baseline: what NeMo RL and veRL do today, as a plan.

For every canonical tensor a destination needs:

1. *gather*: one holder of each source region sends it to the tensor's root (the
   source rank holding most of it; ties go to the lowest rank), which
   assembles the full tensor in the destination dtype;
2. *broadcast*: the root sends the full tensor to every destination rank that
   needs any part of it;
3. each destination copies its pieces out of the full tensor and drops the rest.

Tensors are grouped into rounds whose full tensors fit ``bucket_bytes`` per
root. Built on the same layouts as the reshard plan, so the two can be timed
side by side over the same transport. Into a block-FP8 engine the baseline is NeMo
RL's own: every weight broadcast in the trained dtype into shadows that each inference
rank quantizes (``layouts/fp8_wire.py``, ``engine/quantize.Fp8Steps``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from ...layouts.base import Box, RankLayout, paused_gc
from ...layouts.fp8_wire import Fp8Wire, live_layout, wire_destination, wire_spec
from ...spec.model import ModelSpec
from ..base import DTYPE_BYTES, PlanError
from ..cluster import Placement, Topology
from ..pass1_needs import source_regions
from ..result.fp8_steps import QuantizeStep, destination_steps


@dataclass(frozen=True)
class BroadcastStep:
    """Gather then broadcast one canonical tensor."""

    canonical: str
    shape: tuple[int, ...]
    dtype: str  # wire dtype: the destinations' dtype
    root: int
    gathers: tuple[tuple[int, str, Box, Box], ...]  # (holder, src tensor, src box, canonical box)
    readers: tuple[tuple[int, tuple[tuple[str, Box, Box], ...]], ...]  # dst, (tensor, local, canon)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class BroadcastPlan:
    num_sources: int
    num_destinations: int
    rounds: tuple[tuple[BroadcastStep, ...], ...]
    # Into a block-FP8 engine: the block and each inference rank's shadows to quantize.
    fp8_block: tuple[int, int] | None = None
    quantize_steps: tuple[tuple[QuantizeStep, ...], ...] = ()  # per destination

    @property
    def total_bytes(self) -> int:
        total = 0
        for steps in self.rounds:
            for st in steps:
                gathered = sum(c.numel for h, _, _, c in st.gathers if h != st.root)
                total += gathered * DTYPE_BYTES[st.dtype] + st.nbytes * len(st.readers)
        return total


def plan_broadcast(
    spec: ModelSpec,
    sources: list[RankLayout],
    destinations: list[RankLayout],
    bucket_mb: float = 512,
) -> BroadcastPlan:
    quant = spec.arch.quant
    if quant is not None:  # NeMo RL's shape (module docstring)
        sources, destinations = trained_dtype_wire(spec, sources, destinations)
        spec = wire_spec(spec, destinations)
    regions = source_regions(spec, sources)
    readers: dict[str, dict[int, list[tuple[str, Box, Box]]]] = defaultdict(dict)
    dtypes: dict[str, str] = {}
    for lay in destinations:
        for t in lay.tensors:
            for p in t.pieces:
                readers[p.canonical].setdefault(lay.rank, []).append(
                    (t.name, p.local_box, p.canonical_box)
                )
                dtypes.setdefault(p.canonical, t.dtype)
    steps = []
    for c in spec:
        if c.name not in readers:
            continue
        if c.name not in regions:
            raise PlanError(f"no source rank holds {c.name!r}, which destinations need")
        held: dict[int, int] = defaultdict(int)
        for region in regions[c.name]:
            for h in region.holders:
                held[h.rank] += region.box.numel
        root = min(held, key=lambda r: (-held[r], r))
        gathers = []
        for region in regions[c.name]:
            ranks = {h.rank: h for h in region.holders}
            holder = ranks.get(root) or region.holders[0]  # the root's own copy when it has one
            gathers.append((holder.rank, holder.piece.local, holder.piece.local_box, region.box))
        steps.append(
            BroadcastStep(
                c.name,
                c.shape,
                dtypes[c.name],
                root,
                tuple(gathers),
                tuple((d, tuple(v)) for d, v in sorted(readers[c.name].items())),
            )
        )
    bucket = int(bucket_mb * 2**20)
    rounds: list[list[BroadcastStep]] = []
    load: dict[int, int] = {}
    for st in steps:
        if not rounds or load.get(st.root, 0) + st.nbytes > bucket:
            rounds.append([])
            load = {}
        rounds[-1].append(st)
        load[st.root] = load.get(st.root, 0) + st.nbytes
    return BroadcastPlan(
        len(sources),
        len(destinations),
        tuple(tuple(r) for r in rounds),
        quant.block if quant is not None else None,
        tuple(destination_steps(d) for d in destinations) if quant is not None else (),
    )


def trained_dtype_wire(
    spec: ModelSpec, sources: list[RankLayout], destinations: list[RankLayout]
) -> tuple[list[RankLayout], list[RankLayout]]:
    """A block-FP8 refit's layouts with every weight crossing in the trained dtype: the
    training ranks as they hold their tensors, every e4m3 tensor of the inference ranks
    a shadow."""
    assert spec.arch.quant is not None
    shadows = [t.fp8.dtype for d in destinations for t in d.tensors if t.fp8 is not None]
    dtype = shadows[0] if shadows else spec.unquantized().arch.dtype
    none = Fp8Wire(spec.arch.quant.block, frozenset())  # no weight quantized on the wire
    sources = [live_layout(s) for s in sources]
    return sources, [wire_destination(d, none, dtype) for d in destinations]


# -- its predicted time ------------------------------------------------------------------
@dataclass(frozen=True)
class BroadcastPrediction:
    seconds: float  # gather_seconds + broadcast_seconds
    gather_seconds: float
    broadcast_seconds: float
    num_tensors: int


def broadcast_chain(root: int, readers: list[int], placement: Placement) -> list[tuple[int, int]]:
    """The hops of a pipelined broadcast: the root, then its own node's readers, then
    the other readers node by node (each node entered once, as NCCL orders its rings)."""
    home = placement.node(root)
    order = sorted(readers, key=lambda g: (placement.node(g) != home, placement.node(g), g))
    chain = [root, *order]
    return list(zip(chain, chain[1:]))


def predict_broadcast(bplan: BroadcastPlan, topology: Topology) -> BroadcastPrediction:
    """The gather-broadcast baseline, tensor after tensor.

    Per canonical tensor of ``B`` bytes (destination dtype):

    * gather: every holder other than the root sends its region to the root at once,
      timed by ``cluster.round_time`` (NVLink or NIC as placed);
    * broadcast: a pipelined chain (NCCL ring broadcast without the closing edge) from
      the root through every reader, see :func:`broadcast_chain`:
      ``B / min over hops of bw(hop) + sum over hops of lat(hop)``, where a hop's
      bandwidth and latency are NVLink's inside a node and the NIC's across nodes.

    Total: ``sum over tensors of (gather + broadcast)``.
    """
    topology.check_ranks(bplan.num_sources, bplan.num_destinations)
    placement = topology.placement
    s = bplan.num_sources
    gather = bcast = 0.0
    count = 0
    for steps in bplan.rounds:
        for st in steps:
            count += 1
            item = DTYPE_BYTES[st.dtype]
            msgs = [(h, st.root, box.numel * item) for h, _, _, box in st.gathers]
            gather += topology.round_time(msgs)[0]
            hops = broadcast_chain(st.root, [s + d for d, _ in st.readers], placement)
            if hops:
                rates = [topology.link_rate(x, y) for x, y in hops]
                links = [(bw, topology.latency(link)) for link, bw in rates]
                bcast += st.nbytes / min(bw for bw, _ in links) + sum(lat for _, lat in links)
    return BroadcastPrediction(gather + bcast, gather, bcast, count)


@paused_gc
def predict_broadcast_layouts(
    spec: ModelSpec, sources: list[RankLayout], destinations: list[RankLayout], topology: Topology
) -> BroadcastPrediction:
    """``predict_broadcast(plan_broadcast(spec, sources, destinations), topology)``,
    bit for bit, without building the plan.

    The prediction needs, per canonical tensor a destination reads (in spec order), its
    dtype, its root, its gather messages and its readers' ranks. Ranks listed in each
    other's ``replicas`` hold identical pieces, so all of that is found on one layout per
    replica class and expanded to the class's ranks; the broadcast chain's slowest link
    and latency sum depend only on the root and the reading classes, so each such pair
    is priced once, with :func:`broadcast_chain` as the plan's prediction does.
    """
    quant = spec.arch.quant
    if quant is not None:
        sources, destinations = trained_dtype_wire(spec, sources, destinations)
        spec = wire_spec(spec, destinations)
    topology.check_ranks(len(sources), len(destinations))
    s = len(sources)
    # Sources: per canonical tensor, its distinct boxes and their holders (in rank order).
    source_classes = _replica_classes(sources)
    by_box: dict[str, dict[Box, list[int]]] = defaultdict(dict)
    for lay, members in source_classes:
        for piece in lay.pieces():
            by_box[piece.canonical].setdefault(piece.canonical_box, []).extend(members)
    # Destinations: per canonical tensor, the classes reading it; the first reader's dtype.
    readers: dict[str, list[int]] = defaultdict(list)  # canonical -> class indices
    dtype_of: dict[str, tuple[int, str]] = {}  # canonical -> (lowest reading rank, dtype)
    dest_classes = _replica_classes(destinations)
    for k, (lay, members) in enumerate(dest_classes):
        for t in lay.tensors:
            for p in t.pieces:
                seen = readers[p.canonical]
                if not seen or seen[-1] != k:
                    seen.append(k)
                first = dtype_of.get(p.canonical)
                if first is None or members[0] < first[0]:
                    dtype_of[p.canonical] = (members[0], t.dtype)
    chains: dict[tuple[int, tuple[int, ...]], tuple[float, float]] = {}
    placement = topology.placement
    gather = bcast = 0.0
    count = 0
    for c in spec:
        if c.name not in readers:
            continue
        boxes = by_box.get(c.name)
        if not boxes:
            raise PlanError(f"no source rank holds {c.name!r}, which destinations need")
        held: dict[int, int] = defaultdict(int)
        regions = sorted(boxes.items())
        for box, ranks in regions:
            for r in ranks:
                held[r] += box.numel
        root = min(held, key=lambda r: (-held[r], r))
        item = DTYPE_BYTES[dtype_of[c.name][1]]
        msgs = []
        for box, ranks in regions:
            holder = root if root in ranks else min(ranks)
            msgs.append((holder, root, box.numel * item))
        count += 1
        gather += topology.round_time(msgs)[0]
        key = (root, tuple(readers[c.name]))
        if key not in chains:
            ranks = sorted(s + d for k in key[1] for d in dest_classes[k][1])
            hops = broadcast_chain(root, ranks, placement)
            if not hops:
                chains[key] = (0.0, 0.0)
            else:
                rates = [topology.link_rate(x, y) for x, y in hops]
                links = [(bw, topology.latency(link)) for link, bw in rates]
                chains[key] = (min(bw for bw, _ in links), sum(lat for _, lat in links))
        bw, latency = chains[key]
        if bw:
            nbytes = item
            for n in c.shape:
                nbytes *= n
            bcast += nbytes / bw + latency
    return BroadcastPrediction(gather + bcast, gather, bcast, count)


def _replica_classes(layouts: list[RankLayout]) -> list[tuple[RankLayout, list[int]]]:
    """One layout per replica class (its lowest rank's) and the class's ranks, ascending."""
    classes: dict[int, tuple[RankLayout, list[int]]] = {}
    for lay in layouts:
        key = min(lay.replicas)
        if key not in classes:
            classes[key] = (lay, [])
        classes[key][1].append(lay.rank)
    return list(classes.values())
