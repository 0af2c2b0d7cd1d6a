"""The settings of one plan build, frozen: what passes 2-5 read instead of loose
arguments."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .base import PlanError
from .cluster import LinkModel
from .colocation import Colocation

RELAY_MODES = ("none", "chain", "domain")
RELAY_CHOICES = ("auto", *RELAY_MODES)


@dataclass(frozen=True)
class PlanConfig:
    """How to plan a refit.

    ``bucket_bytes``: per round, every rank stages at most this many bytes of sends and
    of receives. ``relay``: ``"none"`` (every replica gets its own copy from a training
    rank), ``"chain"`` (replicas forward along chains, ``pass4_routes/chain.py``),
    ``"domain"`` (one copy per NVLink domain, forwarded inside it), or ``"auto"`` (with
    ``links``, the mode with the lowest predicted time, ``relay_choice.py``; without,
    ``"none"``). ``links``: the cluster's link model (:class:`~.cluster.Topology`), which
    makes senders, routes and rounds topology-aware. ``carry``: with ``links``, busy
    training ranks and lone inference ranks have NVLink neighbours carry part of their
    bytes (``pass4_routes/carry.py``). ``colocation``: each destination's GPU shares
    with this source rank (``colocation.py``): destinations are planned alone, no relays,
    and a destination's host sends whatever it holds of its needs (a device-local copy).
    """

    bucket_bytes: int = 512 * 2**20
    relay: str = "auto"
    links: LinkModel | None = None
    carry: bool = True
    colocation: Colocation | None = None

    def __post_init__(self) -> None:
        if self.relay not in RELAY_CHOICES:
            raise PlanError(f"unknown relay mode {self.relay!r}; choose one of {RELAY_CHOICES}")
        if self.colocation is not None and self.relay not in ("none", "auto"):
            raise PlanError(
                f"relay={self.relay!r} with a colocated refit: relays forward between "
                "inference ranks, which a colocated refit does not connect; use relay='none'"
            )
        if self.colocation is not None and self.links is not None:
            raise PlanError(
                "a colocated refit with a cluster topology: the topology-aware passes do not "
                "model same-GPU copies yet; plan it without the cluster"
            )
        if self.bucket_bytes <= 0:
            raise ValueError("bucket size must be positive")

    def with_relay(self, relay: str) -> PlanConfig:
        """The same settings for one concrete relay mode (``relay="auto"`` tries each)."""
        return replace(self, relay=relay)

    @property
    def mode(self) -> str:
        """The relay mode passes 2-5 plan: ``"auto"`` without a topology is ``"none"``."""
        return "none" if self.relay == "auto" else self.relay

    def __str__(self) -> str:
        links = "no topology" if self.links is None else "topology"
        return (
            f"PlanConfig(bucket {self.bucket_bytes / 2**20:g} MiB, relay {self.relay}, "
            f"{links}, carry {'on' if self.carry else 'off'}"
            + (f", {self.colocation}" if self.colocation is not None else "")
            + ")"
        )
