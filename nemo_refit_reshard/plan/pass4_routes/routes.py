"""Pass 4, routes: how each transfer travels from its sender to its receivers.

* **direct**: sender to the stored receiver (and, in the same round, to every receiver
  it stands for, ``members``);
* **chain hops** (``relay="chain"``, ``chain.py``): a box several replicas need
  from one sender goes to the first and is forwarded along the others, hop ``k`` at
  least one round after hop ``k - 1``;
* **domain entries** (``relay="domain"``, ``domain.py``): each transfer enters
  every relay run at a balanced position and is forwarded around the run;
* **carried** (with a topology and ``carry``, ``carry.py``): a training rank
  busier than its NVLink domain's mean hands part of its sending to a neighbour, and a
  lone inference rank has neighbours receive part of its copy; the carrier keeps those
  bytes in a relay buffer for one round.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from itertools import groupby
from operator import itemgetter

from ..base import Transfer, sizes_of
from ..cluster import LinkModel
from ..config import PlanConfig
from ..pass2_fanout import FanOut
from ..pass3_senders import Senders
from .carry import choose_carriers, choose_ingress_carriers
from .chain import chain_replicas
from .domain import domain_entries

_PAIR, _FIRST, _SECOND = itemgetter(0, 1), itemgetter(0), itemgetter(1)


@dataclass(frozen=True)
class Routes:
    """Pass 4's result. ``members[r]``: every receiver a transfer stored for ``r``
    reaches in its round; ``chains``: relay runs it is forwarded around afterwards."""

    relay: str
    direct: list[Transfer]
    members: dict[int, tuple[int, ...]]
    chains: list[tuple[int, ...]] = field(default_factory=list)
    hops: list[list[Transfer]] = field(default_factory=list)  # chain hop k+1 at [k]
    carried: list[tuple[Transfer, int]] = field(default_factory=list)  # (transfer, via)

    def link_seconds(self, links: LinkModel, carried: bool = True) -> dict[tuple, float]:
        """Busy seconds of every (rank, link, direction) over the whole refit: each
        byte on the sender's and the receiver's side of every link it crosses (each
        member, every run hop, both carried legs; with ``carried=False`` as if the
        carried transfers went direct). The predicted refit time (rounds run one after
        another, ``analysis/predict.py``) is at least the largest of them."""
        return self._link_seconds(links, self._pair_bytes, carried)

    @cached_property
    def _pair_bytes(self) -> dict[tuple[int, int], int]:
        """Bytes per (sender, stored receiver) of the direct transfers and chain hops."""
        pairs: dict[tuple[int, int], int] = defaultdict(int)
        # runs of one pair summed in C (integers: the grouping changes no total)
        sized = zip(map(_PAIR, self.direct), sizes_of(self.direct))
        for pair, run in groupby(sized, key=_FIRST):
            pairs[pair] += sum(map(_SECOND, run))
        for level in self.hops:
            for t in level:
                pairs[(t.src, t.dst)] += t.nbytes
        return pairs

    def _link_seconds(
        self, links: LinkModel, direct: dict[tuple[int, int], int], carried: bool
    ) -> dict[tuple, float]:
        pairs: dict[tuple[int, int, int], int] = defaultdict(int)
        for (src, dst), nbytes in direct.items():
            pairs[(src, dst, -1)] = nbytes
        for t, via in self.carried:
            pairs[(t.src, t.dst, via if carried else -1)] += t.nbytes
        position = {m: (run, i) for run in self.chains for i, m in enumerate(run)}
        busy: dict[tuple, float] = defaultdict(float)

        def send(a: int, b: int, nbytes: int) -> None:
            link, spb = links.link(a, b)
            busy[(a, link, "out")] += nbytes * spb
            busy[(b, link, "in")] += nbytes * spb

        for (src, dst, via), nbytes in pairs.items():
            if via >= 0:
                send(src, via, nbytes)
                src = via
            for m in self.members.get(dst, (dst,)):
                send(src, m, nbytes)
                run, i = position.get(m, ((m,), 0))
                for k in range(1, len(run)):
                    send(run[(i + k - 1) % len(run)], run[(i + k) % len(run)], nbytes)
        return busy

    def lower_bound(self, links: LinkModel) -> float:
        """Seconds no schedule of these routes can beat: the busiest (rank, link,
        direction)'s total, with the carried legs or without them (the rounds pass
        may drop them), whichever is lower."""
        direct = self._pair_bytes
        bound = max(self._link_seconds(links, direct, True).values(), default=0.0)
        if self.carried:
            bound = min(bound, max(self._link_seconds(links, direct, False).values()))
        return bound

    def __str__(self) -> str:
        hops = sum(len(level) for level in self.hops)
        return (
            f"Routes({self.relay}): {len(self.direct):,} direct, {hops:,} chain hops, "
            f"{len(self.carried):,} carried, {len(self.chains)} relay run(s)"
        )


def plan_routes(senders: Senders, fanout: FanOut, config: PlanConfig, num_sources: int) -> Routes:
    """Pass 4 (module docstring) for the fan-out's relay mode; carried transfers with
    ``config.links`` and ``config.carry``."""
    links = config.links
    transfers = senders.transfers
    if fanout.relay == "chain":
        direct, *hops = chain_replicas(transfers, links)
        return Routes("chain", direct, fanout.members, hops=hops)
    members = fanout.members
    chains = fanout.chains
    if fanout.relay == "domain":
        transfers, members = domain_entries(transfers, fanout.runs_of)
    carried: list[tuple[Transfer, int]] = []
    if links is not None:
        if config.carry:
            transfers, carried = choose_carriers(transfers, links, members, num_sources)
        if fanout.lone:
            transfers, more = choose_ingress_carriers(
                transfers, links, members, chains, list(fanout.lone), carried
            )
            carried += more
    return Routes(fanout.relay, transfers, members, chains, carried=carried)
