"""Predicted refit time of a plan on a cluster model (``cluster.py``), and its traffic.

Link model: a message between two GPUs of one node uses NVLink, one between nodes uses
the sender's NIC and the receiver's NIC. Each GPU has, per direction, ``nvlink`` bytes/s
of NVLink and ``nic`` bytes/s of NIC, independently of each other. All figures are in
bytes and seconds (``1 GB/s = 10**9`` bytes/s).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from ..cluster import Topology
from ..result.refit_plan import RefitPlan


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


def predict_refit(plan: RefitPlan, topology: Topology) -> Prediction:
    """Rounds run one after another; each takes ``cluster.round_time`` of its messages.

    ``seconds = sum over rounds r of max over GPUs g, links L of t_r(g, L)``.
    """
    topology.check_ranks(plan.num_sources, plan.num_destinations)
    placement = topology.placement
    times: list[float] = []
    slowest: tuple[float, int | None, int | None, str | None] = (-1.0, None, None, None)
    acc = [[0, 0, 0, 0] for _ in placement.nodes]
    for r, msgs in enumerate(plan.traffic()):
        t, rank, link = topology.round_time(msgs)
        times.append(t)
        if t > slowest[0]:
            slowest = (t, r, rank, link)
        for src, dst, nbytes in msgs:
            inter = placement.node(src) != placement.node(dst)
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


def predict_timeline(plan: RefitPlan, topology: Topology) -> float:
    """Refit time without a global barrier between rounds, as the engine runs.

    A rank runs its rounds in order and, in a round, waits only for its own
    messages. Its round ``r`` can start once it and every peer it exchanges with in
    ``r`` have finished their round ``r-1``; it then takes its own link time::

        T[g][r] = max(T[g][r-1], max over peers p of T[p][r-1])
                  + max over links L of (max(out_L, in_L) / bw_L + lat_L * n_L)

    (``T[g][r] = T[g][r-1]`` when ``g`` has no message in ``r``). The refit takes
    ``max over g of T[g][last]``. Never more than :func:`predict_refit`.
    """
    topology.check_ranks(plan.num_sources, plan.num_destinations)
    done = [0.0] * (plan.num_sources + plan.num_destinations)
    rate: dict[str, float] = {}
    for msgs in plan.traffic():
        peers: dict[int, set[int]] = defaultdict(set)
        loads: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0, 0])
        for src, dst, nbytes in msgs:
            if src == dst:
                continue
            peers[src].add(dst)
            peers[dst].add(src)
            link, rate[link] = topology.link_rate(src, dst)
            out, inn = loads[(src, link)], loads[(dst, link)]
            out[0] += nbytes
            out[2] += 1
            inn[1] += nbytes
            inn[2] += 1
        own: dict[int, float] = defaultdict(float)
        for (rank, link), (out_b, in_b, count) in loads.items():
            bw, lat = rate[link], topology.latency(link)
            own[rank] = max(own[rank], max(out_b, in_b) / bw + lat * count)
        before = list(done)
        for rank, ps in peers.items():
            start = max([before[rank]] + [before[p] for p in ps])
            done[rank] = start + own[rank]
    return max(done, default=0.0)


def traffic_matrix(plan: RefitPlan, topology: Topology) -> dict[tuple[int, int], int]:
    """Bytes per (source node, destination node), the diagonal being NVLink traffic."""
    out: dict[tuple[int, int], int] = defaultdict(int)
    placement = topology.placement
    for msgs in plan.traffic():
        for src, dst, nbytes in msgs:
            out[(placement.node(src), placement.node(dst))] += nbytes
    return dict(out)
