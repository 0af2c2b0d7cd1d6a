"""Delta refit on a colocated host (``engine/colocated.py``, ``engine/delta/program.py``).

The refit group is the training ranks. A host sends its own messages as deltas against
its baselines, like any training rank; the messages for its guest from the other hosts
arrive at the host (the guest only unpacks the staging), so the host rebuilds each of
them in the staging from the copy it *holds* of that message's last content (in host
memory, never on the GPU the guest's model lives on) and the patch, and then holds the
new content. The guest's own host's message is packed straight into the staging: no
wire, always whole. The group's versions are the hosts' (one per training rank: its
baselines and its held messages move together).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ...plan import PlanError, RankPlan, RefitPlan
from ..program import RankProgram
from ..transport import Transport
from .program import DeltaOptions, DeltaProgram, DeltaStats


class ColocatedDelta:
    """A host's two delta halves: its own sends, its guest's receives."""

    def __init__(
        self,
        rank: int,
        hosts: Sequence[int],
        own: tuple[RankProgram, RefitPlan | RankPlan],
        guest: tuple[RankProgram, RefitPlan | RankPlan] | None,
        device: torch.device,
        options: DeltaOptions,
    ) -> None:
        """Training rank ``rank`` (``hosts[d]``: the training rank on inference rank
        ``d``'s GPU): its own program and plan share, its guest's (None: no guest)."""
        self.rank, self.hosts = rank, hosts
        self.num_sources = own[1].num_sources
        # The receivers rebuild each message from the copies their hosts hold, never from
        # live tensors that could change outside the refit: nothing to check (check.py).
        options = replace(options, check=False)
        self.own = DeltaProgram(own[0], own[1], options)
        self.own.learn_fixed([])  # a held message needs no re-pack: nothing is fixed
        self.guest: DeltaProgram | None = None
        if guest is not None:
            self.guest = DeltaProgram(guest[0], guest[1], options, rank, device)
        self.versions: list[int] = []
        self.stats = DeltaStats()
        self.dense_step = False

    @property
    def version(self) -> int:
        return self.own.version

    @property
    def baseline_bytes(self) -> int:
        held = self.guest.baseline_bytes if self.guest is not None else 0
        return self.own.baseline_bytes + held

    def forget(self) -> None:
        """The next step sends this host's messages whole (its baselines are not trusted)."""
        self.own.version = -1

    def begin(self, network: Transport) -> ColocatedDelta:
        """Every host's version (one gather over the group); refuses a group whose hosts
        disagree on delta refit."""
        shared = network.all_gather_object_str(f"delta {self.own.version}")
        if any(not text.startswith("delta ") for text in shared):
            raise PlanError(
                "colocated refit: some training ranks refit with deltas and others do not; "
                "turn delta refit on for every rank of the group or for none"
            )
        self.versions = [int(text.split()[1]) for text in shared]
        version, self.dense_step = self.own.begin(self.versions)
        if self.guest is not None:
            self.guest.begin(self.versions)
        self.stats = DeltaStats(version=version)
        return self

    def round(self, network: Transport, k: int) -> None:
        """Round ``k`` on the network (packed): headers, then payloads, then the guest's
        messages rebuilt in the staging."""
        hosts, s = self.hosts, self.num_sources
        mine = self.versions[self.rank]
        sends = self.own.encode_round(
            k, mine, lambda d: self.versions[hosts[d - s]], self.dense_step, self.stats
        )
        sends = [(hosts[peer - s], header, payload) for peer, header, payload in sends]
        incoming = self.guest.rounds[k].incoming if self.guest is not None else []
        headers = self.own.exchange_headers(network, k, sends, incoming)
        recvs, patches = [], []
        if self.guest is not None:
            recvs, patches = self.guest.receive_plan(k, headers, mine, self.stats)
        network.exchange(
            [(peer, p) for peer, _, p in sends if p.numel()],
            [(peer, buf) for peer, buf in recvs if buf.numel()],
            k,
        )
        if self.guest is not None:
            self.guest.patch(k, patches)

    def done(self) -> None:
        self.own.done(self.stats)
        if self.guest is not None:
            self.guest.done(self.stats)
