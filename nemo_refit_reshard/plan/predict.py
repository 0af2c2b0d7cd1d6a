"""Predicted refit time on a cluster, the bandwidth floor, and the baseline's prediction.

Link model (``topology.py``): a message between two GPUs of one node uses NVLink, one
between nodes uses the sender's NIC and the receiver's NIC. Each GPU has, per direction,
``nvlink`` bytes/s of NVLink and ``nic`` bytes/s of NIC, independently of each other.
All figures are in bytes and seconds (``1 GB/s = 10**9`` bytes/s).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import product
from typing import Any

from ..layouts.base import Box, RankLayout
from .baseline import BroadcastPlan
from .refit_plan import RefitPlan
from .topology import Cluster, Placement
from .transfer import DTYPE_BYTES

NVLINK, NIC = "nvlink", "nic"


def _link(cluster: Cluster, link: str) -> tuple[float, float]:
    """(bytes/s, seconds of latency per message) of a link type."""
    if link == NVLINK:
        return cluster.nvlink_bytes_per_s, cluster.nvlink_latency_s
    return cluster.nic_bytes_per_s, cluster.nic_latency_s


def _link_of(placement: Placement, src: int, dst: int) -> str:
    return NVLINK if placement.node(src) == placement.node(dst) else NIC


def round_time(
    messages: Iterable[tuple[int, int, int]], cluster: Cluster, placement: Placement
) -> tuple[float, int | None, str | None]:
    """Time of one round of concurrent ``(src, dst, nbytes)`` messages.

    For GPU ``g`` and link type ``L`` (NVLink inside a node, NIC across nodes)::

        t(g, L) = max(out_L(g), in_L(g)) / bw_L + lat_L * n_L(g)

    with ``out_L``/``in_L`` the bytes ``g`` sends/receives over ``L`` this round and
    ``n_L(g)`` the number of messages it sends plus receives over ``L``. The round takes
    ``max over g, L of t(g, L)``. Returns that time and the (rank, link) reaching it
    (ties: lowest rank, then ``nic`` before ``nvlink``); messages to oneself are free.
    """
    return link_round_time(
        messages,
        lambda src, dst: (link := _link_of(placement, src, dst), _link(cluster, link)[0]),
        lambda link: _link(cluster, link)[1],
    )


def link_round_time(
    messages: Iterable[tuple[int, int, int]],
    link_of: Callable[[int, int], tuple[str, float]],
    latency: Callable[[str], float],
) -> tuple[float, int | None, str | None]:
    """:func:`round_time` for any link model: ``link_of(src, dst)`` is ``(link, bytes/s)``,
    ``latency(link)`` seconds per message."""
    loads: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    rate: dict[str, float] = {}
    for src, dst, nbytes in messages:
        if src == dst:
            continue
        link, rate[link] = link_of(src, dst)
        out, inn = loads[(src, link)], loads[(dst, link)]
        out[0] += nbytes
        out[2] += 1
        inn[1] += nbytes
        inn[2] += 1
    best: tuple[float, int | None, str | None] = (0.0, None, None)
    for (rank, link), (out_b, in_b, count) in sorted(loads.items()):
        t = max(out_b, in_b) / rate[link] + latency(link) * count
        if t > best[0]:
            best = (t, rank, link)
    return best


@dataclass(frozen=True)
class GpuBytes:
    """Bytes one refit-group rank sends / receives over the whole refit, per link type."""

    sent_nvlink: int = 0
    sent_nic: int = 0
    received_nvlink: int = 0
    received_nic: int = 0


@dataclass(frozen=True)
class Prediction:
    seconds: float  # sum of round_seconds
    round_seconds: tuple[float, ...]
    slowest_round: int | None
    bottleneck_rank: int | None  # the rank and link that set the slowest round's time
    bottleneck_link: str | None
    gpu_bytes: tuple[GpuBytes, ...]  # per refit-group rank

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "round_seconds": list(self.round_seconds),
            "slowest_round": self.slowest_round,
            "bottleneck_rank": self.bottleneck_rank,
            "bottleneck_link": self.bottleneck_link,
        }


def predict_refit(plan: RefitPlan, cluster: Cluster, placement: Placement) -> Prediction:
    """Rounds run one after another; each takes :func:`round_time` of its messages.

    ``seconds = sum over rounds r of max over GPUs g, links L of t_r(g, L)``.
    """
    _check_placement(placement, plan.num_sources, plan.num_destinations)
    times: list[float] = []
    slowest: tuple[float, int | None, int | None, str | None] = (-1.0, None, None, None)
    acc = [[0, 0, 0, 0] for _ in placement.nodes]
    for r, msgs in enumerate(plan.traffic()):
        t, rank, link = round_time(msgs, cluster, placement)
        times.append(t)
        if t > slowest[0]:
            slowest = (t, r, rank, link)
        for src, dst, nbytes in msgs:
            inter = _link_of(placement, src, dst) == NIC
            acc[src][int(inter)] += nbytes
            acc[dst][2 + int(inter)] += nbytes
    return Prediction(
        seconds=sum(times),
        round_seconds=tuple(times),
        slowest_round=slowest[1],
        bottleneck_rank=slowest[2],
        bottleneck_link=slowest[3],
        gpu_bytes=tuple(GpuBytes(*a) for a in acc),
    )


def predict_timeline(plan: RefitPlan, cluster: Cluster, placement: Placement) -> float:
    """Refit time without a global barrier between rounds, as the engine runs.

    A rank runs its rounds in order and, in a round, waits only for its own
    messages. Its round ``r`` can start once it and every peer it exchanges with in
    ``r`` have finished their round ``r-1``; it then takes its own link time::

        T[g][r] = max(T[g][r-1], max over peers p of T[p][r-1])
                  + max over links L of (max(out_L, in_L) / bw_L + lat_L * n_L)

    (``T[g][r] = T[g][r-1]`` when ``g`` has no message in ``r``). The refit takes
    ``max over g of T[g][last]``. Never more than :func:`predict_refit`.
    """
    _check_placement(placement, plan.num_sources, plan.num_destinations)
    done = [0.0] * (plan.num_sources + plan.num_destinations)
    for msgs in plan.traffic():
        peers: dict[int, set[int]] = defaultdict(set)
        loads: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0, 0])
        for src, dst, nbytes in msgs:
            if src == dst:
                continue
            peers[src].add(dst)
            peers[dst].add(src)
            link = _link_of(placement, src, dst)
            out, inn = loads[(src, link)], loads[(dst, link)]
            out[0] += nbytes
            out[2] += 1
            inn[1] += nbytes
            inn[2] += 1
        own: dict[int, float] = defaultdict(float)
        for (rank, link), (out_b, in_b, count) in loads.items():
            bw, lat = _link(cluster, link)
            own[rank] = max(own[rank], max(out_b, in_b) / bw + lat * count)
        before = list(done)
        for rank, ps in peers.items():
            start = max([before[rank]] + [before[p] for p in ps])
            done[rank] = start + own[rank]
    return max(done, default=0.0)


def traffic_matrix(plan: RefitPlan, placement: Placement) -> dict[tuple[int, int], int]:
    """Bytes per (source node, destination node), the diagonal being NVLink traffic."""
    out: dict[tuple[int, int], int] = defaultdict(int)
    for msgs in plan.traffic():
        for src, dst, nbytes in msgs:
            out[(placement.node(src), placement.node(dst))] += nbytes
    return dict(out)


def _check_placement(placement: Placement, num_sources: int, num_destinations: int) -> None:
    if (placement.num_sources, placement.num_destinations) != (num_sources, num_destinations):
        raise ValueError(
            f"placement is for {placement.num_sources} training + "
            f"{placement.num_destinations} inference ranks, the plan has "
            f"{num_sources} + {num_destinations}"
        )


# -- the bandwidth floor --------------------------------------------------------------------
@dataclass(frozen=True)
class FloorTerm:
    key: str  # "a".."d"
    what: str
    seconds: float
    nbytes: int
    where: str


@dataclass(frozen=True)
class Floor:
    seconds: float
    binding: FloorTerm  # the largest term
    terms: tuple[FloorTerm, ...]  # the largest instance of each of (a)-(d)

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "binding": self.binding.key,
            "terms": {t.key: vars(t) for t in self.terms},
        }


def _classes(layouts: list[RankLayout], offset: int) -> dict[int, tuple[RankLayout, list[int]]]:
    """Replica class (lowest replica) -> (one layout of it, its refit-group ranks)."""
    out: dict[int, tuple[RankLayout, list[int]]] = {}
    for lay in layouts:
        key = min(lay.replicas)
        out.setdefault(key, (lay, []))[1].append(offset + lay.rank)
    return out


def _cells(box: Box, cuts: list[list[int]]) -> Iterable[tuple[int, ...]]:
    """Indices of the grid cells (between consecutive ``cuts`` per dim) inside ``box``."""
    return product(
        *(
            range(bisect_left(c, o), bisect_left(c, o + s))
            for c, o, s in zip(cuts, box.offsets, box.sizes)
        )
    )


def bandwidth_floor(
    plan: RefitPlan,
    sources: list[RankLayout],
    destinations: list[RankLayout],
    cluster: Cluster,
    placement: Placement,
) -> Floor:
    """A lower bound on any refit's time in this link model: the largest of

    (a) per inference node n: ``|N_n \\ H_n| / (k_n * nic)`` — the bytes of distinct
        elements its GPUs need and no training GPU on n holds must enter through the
        NICs of its ``k_n`` refit-group GPUs;
    (b) per inference GPU: ``|N_g| / (nic + nvlink)`` — its distinct needed bytes enter
        through its own NIC and NVLink;
    (c) per training node n: ``|{x held only on n, needed on another node}| / (k_n * nic)``;
    (d) ``|{x needed on a node with no training rank}| / (sum of k_n over training nodes
        * nic)`` — the training pool's egress.

    ``N`` = needed elements, ``H`` = held elements, sizes in bytes of the destination
    dtype (the wire dtype); ``k_n`` = refit-group ranks on node n (``gpus_per_node`` for a
    full node). Latency is ignored. Element sets are unions of canonical boxes, measured
    on the grid cut by every box boundary of that canonical tensor, never element-wise.
    """
    if (plan.num_sources, plan.num_destinations) != (len(sources), len(destinations)):
        raise ValueError(
            f"plan is for {plan.num_sources} + {plan.num_destinations} ranks, the layouts "
            f"are {len(sources)} + {len(destinations)}"
        )
    _check_placement(placement, len(sources), len(destinations))
    s = len(sources)
    node_of = placement.node
    held: dict[str, dict[Box, set[int]]] = defaultdict(lambda: defaultdict(set))
    for lay, ranks in _classes(sources, 0).values():
        nodes = {node_of(r) for r in ranks}
        for p in lay.pieces():
            held[p.canonical][p.canonical_box] |= nodes
    needed: dict[str, dict[Box, set[tuple[str, int]]]] = defaultdict(lambda: defaultdict(set))
    itemsize: dict[str, int] = {}
    inference_classes = _classes(destinations, s)
    for cls, (lay, ranks) in inference_classes.items():
        labels = {("n", node_of(r)) for r in ranks} | {("c", cls)}
        for t in lay.tensors:
            size = DTYPE_BYTES[t.dtype]
            for p in t.pieces:
                needed[p.canonical][p.canonical_box] |= labels
                itemsize[p.canonical] = min(size, itemsize.get(p.canonical, size))
    train_nodes = set(placement.training_nodes)
    a: dict[int, int] = defaultdict(int)
    b: dict[int, int] = defaultdict(int)
    c: dict[int, int] = defaultdict(int)
    d = 0
    for name, need_boxes in needed.items():
        hold_boxes = held.get(name, {})
        bounds = [set() for _ in next(iter(need_boxes)).offsets]
        for box in (*need_boxes, *hold_boxes):
            for dim, (o, sz) in enumerate(zip(box.offsets, box.sizes)):
                bounds[dim].update((o, o + sz))
        cuts = [sorted(x) for x in bounds]
        cell_need: dict[tuple[int, ...], set[tuple[str, int]]] = defaultdict(set)
        for box, labels in need_boxes.items():
            for cell in _cells(box, cuts):
                cell_need[cell] |= labels
        cell_held: dict[tuple[int, ...], set[int]] = defaultdict(set)
        for box, nodes in hold_boxes.items():
            for cell in _cells(box, cuts):
                if cell in cell_need:
                    cell_held[cell] |= nodes
        for cell, labels in cell_need.items():
            nbytes = itemsize[name]
            for dim, i in enumerate(cell):
                nbytes *= cuts[dim][i + 1] - cuts[dim][i]
            holders = cell_held.get(cell, set())
            need_nodes = {v for k, v in labels if k == "n"}
            for n in need_nodes - holders:
                a[n] += nbytes
            for k, v in labels:
                if k == "c":
                    b[v] += nbytes
            if len(holders) == 1 and need_nodes - holders:
                c[next(iter(holders))] += nbytes
            if need_nodes - train_nodes:
                d += nbytes
    k = placement.node_sizes()
    nic, nvlink = cluster.nic_bytes_per_s, cluster.nvlink_bytes_per_s
    terms = [
        _largest(
            "a", "inference node ingress", {f"node {n}": (v, k[n] * nic) for n, v in a.items()}
        ),
        _largest(
            "b",
            "inference GPU ingress",
            {f"rank {inference_classes[x][1][0]}": (v, nic + nvlink) for x, v in b.items()},
        ),
        _largest("c", "training node egress", {f"node {n}": (v, k[n] * nic) for n, v in c.items()}),
        _largest(
            "d",
            "training pool egress",
            {"training pool": (d, sum(k[n] for n in train_nodes) * nic)} if d else {},
        ),
    ]
    binding = max(terms, key=lambda t: t.seconds)  # first of equals: a, b, c, d
    return Floor(binding.seconds, binding, tuple(terms))


def _largest(key: str, what: str, items: dict[str, tuple[int, float]]) -> FloorTerm:
    """The item with the most seconds (bytes / rate); ties: "node 2" before "node 10"."""
    best = FloorTerm(key, what, 0.0, 0, "-")
    for where, (nbytes, rate) in sorted(items.items(), key=lambda kv: (len(kv[0]), kv[0])):
        if nbytes / rate > best.seconds:
            best = FloorTerm(key, what, nbytes / rate, nbytes, where)
    return best


# -- the gather-broadcast baseline ----------------------------------------------------------
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


def predict_broadcast(
    bplan: BroadcastPlan, cluster: Cluster, placement: Placement
) -> BroadcastPrediction:
    """The gather-broadcast baseline, tensor after tensor.

    Per canonical tensor of ``B`` bytes (destination dtype):

    * gather: every holder other than the root sends its region to the root at once,
      timed by :func:`round_time` (NVLink or NIC as placed);
    * broadcast: a pipelined chain (NCCL ring broadcast without the closing edge) from
      the root through every reader, see :func:`broadcast_chain`:
      ``B / min over hops of bw(hop) + sum over hops of lat(hop)``, where a hop's
      bandwidth and latency are NVLink's inside a node and the NIC's across nodes.

    Total: ``sum over tensors of (gather + broadcast)``.
    """
    _check_placement(placement, bplan.num_sources, bplan.num_destinations)
    s = bplan.num_sources
    gather = bcast = 0.0
    count = 0
    for steps in bplan.rounds:
        for st in steps:
            count += 1
            item = DTYPE_BYTES[st.dtype]
            msgs = [(h, st.root, box.numel * item) for h, _, _, box in st.gathers]
            gather += round_time(msgs, cluster, placement)[0]
            hops = broadcast_chain(st.root, [s + d for d, _ in st.readers], placement)
            if hops:
                links = [_link(cluster, _link_of(placement, x, y)) for x, y in hops]
                bcast += st.nbytes / min(bw for bw, _ in links) + sum(lat for _, lat in links)
    return BroadcastPrediction(gather + bcast, gather, bcast, count)
