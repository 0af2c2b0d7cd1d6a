"""The cluster model, one for planning and for prediction: link speeds (:class:`Cluster`),
which node holds each refit-group rank (:class:`Placement`), both together as the link
model the passes plan on (:class:`Topology`, a :class:`LinkModel`), NVLink domains of a
set of ranks (:func:`nvlink_domains`), and the time of one round (:func:`round_time`).

Units: bandwidths are GB/s (``1 GB = 10**9`` bytes) per GPU per direction, latencies are
microseconds. ``nvlink_gbps=450,nic_gbps=50`` is 450 GB/s of NVLink per GPU and one
400 Gb/s NIC (= 50 GB/s) per GPU; every GPU's inter-node traffic goes through its own NIC
(rail-optimised fabric), its intra-node traffic over NVLink.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Protocol

NVLINK, NIC = "nvlink", "nic"
CLUSTER_KEYS = ("gpus_per_node", "nvlink_gbps", "nic_gbps", "nvlink_latency_us", "nic_latency_us")


@dataclass(frozen=True)
class Cluster:
    """GPU nodes joined by NICs; GPUs inside a node joined by NVLink.

    ``nvlink_gbps`` / ``nic_gbps``: GB/s (10**9 bytes/s) per GPU per direction, so a GPU
    can send and receive ``nic_gbps`` each at the same time over its NIC, and likewise over
    NVLink. ``nvlink_latency_us`` / ``nic_latency_us``: fixed cost of one message on that
    link, in microseconds.
    """

    gpus_per_node: int = 8
    nvlink_gbps: float = 450.0
    nic_gbps: float = 50.0
    nvlink_latency_us: float = 5.0
    nic_latency_us: float = 10.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"cluster {f.name}={v!r} must be a positive number")
        if not isinstance(self.gpus_per_node, int):
            raise ValueError(f"cluster gpus_per_node={self.gpus_per_node!r} must be an integer")

    @property
    def nvlink_bytes_per_s(self) -> float:
        return self.nvlink_gbps * 1e9

    @property
    def nic_bytes_per_s(self) -> float:
        return self.nic_gbps * 1e9

    @property
    def nvlink_latency_s(self) -> float:
        return self.nvlink_latency_us * 1e-6

    @property
    def nic_latency_s(self) -> float:
        return self.nic_latency_us * 1e-6

    @classmethod
    def parse(cls, text: str) -> Cluster:
        """``"gpus_per_node=8,nvlink_gbps=450,nic_gbps=50"``; omitted keys keep defaults."""
        out: dict[str, int | float] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep:
                raise ValueError(f"cluster item {item!r} is not key=value")
            if key not in CLUSTER_KEYS:
                raise ValueError(f"unknown cluster key {key!r}; allowed: {', '.join(CLUSTER_KEYS)}")
            if key in out:
                raise ValueError(f"cluster key {key!r} given twice")
            try:
                number: int | float = int(value) if key == "gpus_per_node" else float(value)
            except ValueError:
                kind = "an integer" if key == "gpus_per_node" else "a number"
                raise ValueError(f"cluster {key}={value!r} is not {kind}") from None
            if not number > 0:
                raise ValueError(f"cluster {key}={number} must be > 0")
            out[key] = number
        return cls(**out)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name):g}" for f in fields(self))


@dataclass(frozen=True)
class Placement:
    """``nodes[g]`` is the node of refit-group rank ``g`` (training ranks ``0..S-1``, then
    inference ranks ``S..S+D-1``). Build it with :meth:`packed` or :meth:`explicit`."""

    num_sources: int
    nodes: tuple[int, ...]

    @property
    def num_destinations(self) -> int:
        return len(self.nodes) - self.num_sources

    @classmethod
    def packed(cls, num_sources: int, num_destinations: int, cluster: Cluster) -> Placement:
        """Training ranks fill nodes ``0, 1, ...`` in rank order, ``gpus_per_node`` each;
        inference ranks do the same from the first node after the training nodes (the
        two pools never share a node)."""
        g = cluster.gpus_per_node
        train_nodes = -(-num_sources // g)
        nodes = [r // g for r in range(num_sources)]
        nodes += [train_nodes + d // g for d in range(num_destinations)]
        return cls(num_sources, tuple(nodes))

    @classmethod
    def explicit(
        cls, nodes: tuple[int, ...], num_sources: int, num_destinations: int, cluster: Cluster
    ) -> Placement:
        """Nodes given per refit-group rank; checked for length, values and node capacity."""
        nodes = tuple(nodes)
        if len(nodes) != num_sources + num_destinations:
            raise ValueError(
                f"placement names {len(nodes)} node(s) but the refit group has "
                f"{num_sources} training + {num_destinations} inference = "
                f"{num_sources + num_destinations} ranks"
            )
        for rank, n in enumerate(nodes):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"placement node {n!r} of rank {rank} must be an integer >= 0")
        for n in sorted(set(nodes)):
            ranks = [r for r, m in enumerate(nodes) if m == n]
            if len(ranks) > cluster.gpus_per_node:
                raise ValueError(
                    f"placement puts {len(ranks)} ranks on node {n} ({ranks[:10]}...) but a "
                    f"node has gpus_per_node={cluster.gpus_per_node} GPUs"
                )
        return cls(num_sources, nodes)

    def node(self, rank: int) -> int:
        return self.nodes[rank]

    def ranks_on(self, node: int) -> list[int]:
        """Every refit-group rank placed on ``node``, in increasing order."""
        return [r for r, n in enumerate(self.nodes) if n == node]

    def node_sizes(self) -> dict[int, int]:
        """Refit-group ranks per node."""
        sizes: dict[int, int] = {}
        for n in self.nodes:
            sizes[n] = sizes.get(n, 0) + 1
        return sizes

    @property
    def training_nodes(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.nodes[: self.num_sources])))

    @property
    def inference_nodes(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.nodes[self.num_sources :])))


class LinkModel(Protocol):
    """What the passes need to know about the network (:class:`Topology` is one)."""

    def link(self, src: int, dst: int) -> tuple[str, float]:
        """``(link id, seconds per byte)`` of the sender's side of ``src -> dst``
        (e.g. its NVLink port when ``dst`` is on the same node, else its NIC)."""
        ...

    def latency(self, link: str) -> float:
        """Seconds one message costs on a link of this id, whatever its size."""
        ...


@dataclass(frozen=True)
class Topology:
    """A cluster and a placement: the :class:`LinkModel` ``plan_refit(..., links=...)``
    plans on, and what the predictions (``analysis/``) price plans with."""

    cluster: Cluster
    placement: Placement

    def link(self, src: int, dst: int) -> tuple[str, float]:
        """``("nvlink", s/byte)`` when both ranks share a node, else ``("nic", s/byte)``."""
        if self.placement.node(src) == self.placement.node(dst):
            return NVLINK, 1 / self.cluster.nvlink_bytes_per_s
        return NIC, 1 / self.cluster.nic_bytes_per_s

    def link_rate(self, src: int, dst: int) -> tuple[str, float]:
        """``(link, bytes/s)`` of ``src -> dst``: :meth:`link` with the rate itself."""
        if self.placement.node(src) == self.placement.node(dst):
            return NVLINK, self.cluster.nvlink_bytes_per_s
        return NIC, self.cluster.nic_bytes_per_s

    def latency(self, link: str) -> float:
        """Seconds per message on ``"nvlink"`` or ``"nic"``."""
        if link == NVLINK:
            return self.cluster.nvlink_latency_s
        if link == NIC:
            return self.cluster.nic_latency_s
        raise ValueError(f"unknown link {link!r}; expected 'nvlink' or 'nic'")

    def round_time(
        self, messages: Iterable[tuple[int, int, int]]
    ) -> tuple[float, int | None, str | None]:
        """:func:`round_time` of ``(src, dst, nbytes)`` messages on this cluster."""
        return round_time(messages, self.link_rate, self.latency)

    def check_ranks(self, num_sources: int, num_destinations: int) -> None:
        """Refuse a placement made for another refit group."""
        p = self.placement
        if (p.num_sources, p.num_destinations) != (num_sources, num_destinations):
            raise ValueError(
                f"placement is for {p.num_sources} training + {p.num_destinations} "
                f"inference ranks, the plan has {num_sources} + {num_destinations}"
            )


def nvlink_domains(
    ranks: Iterable[int], links: LinkModel, contiguous: bool = False
) -> list[list[int]]:
    """``ranks`` grouped by NVLink domain, each group in the order of ``ranks``, groups in
    the order of their first member.

    By default a group is every rank joined to its first member by ``nvlink`` both ways.
    ``contiguous=True`` groups only runs of consecutive entries of ``ranks`` whose link
    from the run's first member is ``nvlink``: a rank of an earlier domain that comes
    after a rank of another starts a new group (relay chains and ``relay="domain"`` runs
    forward along consecutive members; on a placement that packs each node's ranks
    together both give the same groups)."""
    domains: list[list[int]] = []
    for rank in ranks:
        if contiguous:
            if domains and links.link(domains[-1][0], rank)[0] == NVLINK:
                domains[-1].append(rank)
            else:
                domains.append([rank])
            continue
        for d in domains:
            if links.link(d[0], rank)[0] == links.link(rank, d[0])[0] == NVLINK:
                d.append(rank)
                break
        else:
            domains.append([rank])
    return domains


def round_time(
    messages: Iterable[tuple[int, int, int]],
    link_rate: Callable[[int, int], tuple[str, float]],
    latency: Callable[[str], float],
) -> tuple[float, int | None, str | None]:
    """Time of one round of concurrent ``(src, dst, nbytes)`` messages.

    For GPU ``g`` and link type ``L`` (``link_rate(src, dst)`` is ``(L, bytes/s)``)::

        t(g, L) = max(out_L(g), in_L(g)) / bw_L + lat_L * n_L(g)

    with ``out_L``/``in_L`` the bytes ``g`` sends/receives over ``L`` this round and
    ``n_L(g)`` the number of messages it sends plus receives over ``L``. The round takes
    ``max over g, L of t(g, L)``. Returns that time and the (rank, link) reaching it
    (ties: lowest rank, then ``nic`` before ``nvlink``); messages to oneself are free.
    """
    loads: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    rate: dict[str, float] = {}
    for src, dst, nbytes in messages:
        if src == dst:
            continue
        link, rate[link] = link_rate(src, dst)
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
