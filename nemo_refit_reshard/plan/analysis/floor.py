"""The bandwidth floor: a lower bound on any refit's time in the cluster model, computed
from the layouts (what is needed where, what is held where), not from a plan."""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import product
from typing import Any

from ...layouts.base import RankLayout, paused_gc
from ..base import DTYPE_BYTES
from ..cluster import Topology
from ..result.refit_plan import RefitPlan


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


_BoxKey = tuple[tuple[int, ...], tuple[int, ...]]  # a Box's (offsets, sizes)


def _cells(box: _BoxKey, cuts: list[list[int]]) -> Iterable[tuple[int, ...]]:
    """Indices of the grid cells (between consecutive ``cuts`` per dim) inside ``box``."""
    offsets, sizes = box
    return product(
        *(range(bisect_left(c, o), bisect_left(c, o + s)) for c, o, s in zip(cuts, offsets, sizes))
    )


@paused_gc
def bandwidth_floor(
    plan: RefitPlan,
    sources: list[RankLayout],
    destinations: list[RankLayout],
    topology: Topology,
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
    topology.check_ranks(len(sources), len(destinations))
    cluster, placement = topology.cluster, topology.placement
    s = len(sources)
    node_of = placement.node
    # Boxes as (offsets, sizes) keys: hashing tuples is done in C, a Box's hash in Python,
    # and there are millions of pieces at 256 GPUs.
    held: dict[str, dict[_BoxKey, set[int]]] = defaultdict(lambda: defaultdict(set))
    for lay, ranks in _classes(sources, 0).values():
        nodes = {node_of(r) for r in ranks}
        for p in lay.pieces():
            box = p.canonical_box
            held[p.canonical][box.offsets, box.sizes] |= nodes
    # Per canonical tensor and box, the inference classes needing it (each class once).
    needed: dict[str, dict[_BoxKey, list[int]]] = defaultdict(dict)
    itemsize: dict[str, int] = {}
    inference_classes = _classes(destinations, s)
    labels: list[frozenset[tuple[str, int]]] = []
    for k, (cls, (lay, ranks)) in enumerate(inference_classes.items()):
        labels.append(frozenset({("n", node_of(r)) for r in ranks} | {("c", cls)}))
        for t in lay.tensors:
            size = DTYPE_BYTES[t.dtype]
            for p in t.pieces:
                box = p.canonical_box
                classes = needed[p.canonical].setdefault((box.offsets, box.sizes), [])
                if not classes or classes[-1] != k:
                    classes.append(k)
                known = itemsize.get(p.canonical)
                if known is None or size < known:
                    itemsize[p.canonical] = size
    train_nodes = frozenset(placement.training_nodes)
    a: dict[int, int] = defaultdict(int)
    b: dict[int, int] = defaultdict(int)
    c: dict[int, int] = defaultdict(int)
    d = 0
    # Tensors alike (every expert of a layer kind held by one training node set) give
    # the same terms: computed once per (bytes per element, needs, holders).
    seen: dict[tuple, _Terms] = {}
    for name, need_boxes in needed.items():
        hold_boxes = held.get(name, {})
        key = (
            itemsize[name],
            tuple((box, tuple(ks)) for box, ks in need_boxes.items()),
            tuple((box, frozenset(nodes)) for box, nodes in hold_boxes.items()),
        )
        terms = seen.get(key)
        if terms is None:
            terms = seen[key] = _tensor_terms(key, labels, train_nodes)
        for n, v in terms.a:
            a[n] += v
        for x, v in terms.b:
            b[x] += v
        for n, v in terms.c:
            c[n] += v
        d += terms.d
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


@dataclass(frozen=True)
class _Terms:
    """One canonical tensor's bytes in each term: (node or class, bytes) pairs."""

    a: tuple[tuple[int, int], ...]
    b: tuple[tuple[int, int], ...]
    c: tuple[tuple[int, int], ...]
    d: int


def _tensor_terms(
    key: tuple, labels: list[frozenset[tuple[str, int]]], train_nodes: frozenset[int]
) -> _Terms:
    """One tensor's contribution to (a)-(d) (``bandwidth_floor``), from its need boxes
    (with the classes needing each), its held boxes (with the nodes holding each) and
    its bytes per element: on the grid cut by every box boundary, per cell."""
    item, need, hold = key
    bounds: list[set[int]] = [set() for _ in need[0][0][0]]
    for (offsets, sizes), _ in (*need, *hold):
        for dim, (o, sz) in enumerate(zip(offsets, sizes)):
            bounds[dim].update((o, o + sz))
    cuts = [sorted(x) for x in bounds]
    cell_need: dict[tuple[int, ...], set[tuple[str, int]]] = defaultdict(set)
    for box, ks in need:
        box_labels = frozenset().union(*(labels[k] for k in ks))
        for cell in _cells(box, cuts):
            cell_need[cell] |= box_labels
    cell_held: dict[tuple[int, ...], set[int]] = defaultdict(set)
    for box, nodes in hold:
        for cell in _cells(box, cuts):
            if cell in cell_need:
                cell_held[cell] |= nodes
    a: dict[int, int] = defaultdict(int)
    b: dict[int, int] = defaultdict(int)
    c: dict[int, int] = defaultdict(int)
    d = 0
    for cell, cell_labels in cell_need.items():
        nbytes = item
        for dim, i in enumerate(cell):
            nbytes *= cuts[dim][i + 1] - cuts[dim][i]
        holders = cell_held.get(cell, set())
        need_nodes = {v for k, v in cell_labels if k == "n"}
        for n in need_nodes - holders:
            a[n] += nbytes
        for k, v in cell_labels:
            if k == "c":
                b[v] += nbytes
        if len(holders) == 1 and need_nodes - holders:
            c[next(iter(holders))] += nbytes
        if need_nodes - train_nodes:
            d += nbytes
    return _Terms(tuple(a.items()), tuple(b.items()), tuple(c.items()), d)


def _largest(key: str, what: str, items: dict[str, tuple[int, float]]) -> FloorTerm:
    """The item with the most seconds (bytes / rate); ties: "node 2" before "node 10"."""
    best = FloorTerm(key, what, 0.0, 0, "-")
    for where, (nbytes, rate) in sorted(items.items(), key=lambda kv: (len(kv[0]), kv[0])):
        if nbytes / rate > best.seconds:
            best = FloorTerm(key, what, nbytes / rate, nbytes, where)
    return best
