"""Colocated refit: every inference rank shares its GPU with one training rank.

In a colocated deployment (NeMo RL's ``policy.generation.colocated.enabled``, veRL's
hybrid engine, vLLM's ``ipc`` backend) each GPU hosts one training rank and at most one
vLLM worker. The refit then runs over the *training ranks'* communicator only: training
rank ``h`` receives what its co-located worker needs from the other training ranks into
bounded staging, which the worker reads over a same-device handle and unpacks into its
live parameters. What the worker needs from ``h`` itself is a device-local copy, never
sent.

The plan records that placement as ``hosts``: ``hosts[d]`` is the training (source) rank
on destination ``d``'s GPU. Planning with it (``plan_refit(..., colocation=...)``):

* every destination is planned on its own (replicas on different GPUs have different
  hosts, so they share no messages) and no relays run (``relay="none"``);
* replica choice takes the host whenever it holds the box (a local copy, zero bytes on
  the interconnect) and balances the rest as usual (``pass3_senders``).

A transfer whose sender is the receiver's host costs no interconnect bytes:
:func:`colocated_bytes` splits a plan's bytes into the two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .base import PlanError


@dataclass(frozen=True)
class Colocation:
    """``hosts[d]``: the source rank sharing destination ``d``'s GPU."""

    hosts: tuple[int, ...]

    @classmethod
    def from_devices(cls, train_devices: Sequence[str], infer_devices: Sequence[str]) -> Colocation:
        """The placement from each rank's device name (``"node0:gpu3"``, any string that
        names one GPU), training ranks and inference ranks in rank order. Refused, before
        any transfer, with one line: a GPU with two training ranks or two inference
        ranks, an inference rank with no training rank on its GPU."""
        first = _one_per_gpu(
            train_devices,
            "training ranks",
            "each GPU must host one training rank (fix the placement)",
        )
        _one_per_gpu(infer_devices, "inference ranks", "each GPU must host at most one vLLM worker")
        hosts = []
        for rank, device in enumerate(infer_devices):
            if device not in first:
                raise PlanError(
                    f"colocated refit: inference rank {rank} on GPU {device} has no training "
                    "rank on its GPU; place one there or run the separate-pools refit"
                )
            hosts.append(first[device])
        return cls(tuple(hosts))

    @classmethod
    def same_index(cls, num_sources: int, num_destinations: int) -> Colocation:
        """Inference rank ``d`` on training rank ``d``'s GPU (the usual colocated
        deployment: both worlds over the same GPUs in the same order)."""
        if num_destinations > num_sources:
            raise PlanError(
                f"colocated refit: {num_destinations} inference ranks but {num_sources} "
                "training ranks; every inference rank needs a training rank on its GPU"
            )
        return cls(tuple(range(num_destinations)))

    def check(self, num_sources: int, num_destinations: int) -> None:
        """Raise ``PlanError`` unless this placement fits the given worlds."""
        if len(self.hosts) != num_destinations:
            raise PlanError(
                f"colocated refit: a host for {len(self.hosts)} inference ranks, the plan has "
                f"{num_destinations}"
            )
        bad = [h for h in self.hosts if not 0 <= h < num_sources]
        if bad:
            raise PlanError(
                f"colocated refit: host rank(s) {bad} outside the {num_sources} training ranks"
            )
        if len(set(self.hosts)) != len(self.hosts):
            raise PlanError(
                f"colocated refit: hosts {list(self.hosts)} put two inference ranks on one "
                "training rank's GPU; each GPU hosts at most one vLLM worker"
            )

    def guest_of(self, source: int, num_sources: int) -> int | None:
        """The refit-group rank of the destination on ``source``'s GPU, if any."""
        for d, h in enumerate(self.hosts):
            if h == source:
                return num_sources + d
        return None

    def __str__(self) -> str:
        pairs = ", ".join(f"{d}@{h}" for d, h in enumerate(self.hosts))
        return f"Colocation(inference@training: {pairs})"


@dataclass(frozen=True)
class ColocatedBytes:
    """A colocated plan's bytes: device-local copies and bytes over the interconnect."""

    local: int
    network: int

    def __str__(self) -> str:
        return f"{self.network:,} bytes over the interconnect, {self.local:,} device-local"


def colocated_bytes(traffic: Sequence[Sequence[tuple[int, int, int]]], hosts: Sequence[int],
                    num_sources: int) -> ColocatedBytes:  # fmt: skip
    """Split ``plan.traffic()`` (per round, ``(src, dst, bytes)``) by whether the sender
    is the receiver's host."""
    local = network = 0
    for messages in traffic:
        for src, dst, nbytes in messages:
            if dst >= num_sources and hosts[dst - num_sources] == src:
                local += nbytes
            else:
                network += nbytes
    return ColocatedBytes(local, network)


def _one_per_gpu(devices: Sequence[str], what: str, fix: str) -> dict[str, int]:
    """``{device: rank}``, refused when two of ``devices`` name the same GPU."""
    first: dict[str, int] = {}
    for rank, device in enumerate(devices):
        if device in first:
            raise PlanError(
                f"colocated refit: GPU {device} hosts {what} {first[device]} and {rank}; {fix}"
            )
        first[device] = rank
    return first
