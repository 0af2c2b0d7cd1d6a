"""Pass 5, rounds: which round each part of each route goes in.

Per round every rank stages at most ``bucket_bytes`` of sends and of receives.

* With a topology (direct and ``relay="domain"`` routes) rounds get one time budget
  for every (GPU, link) and are filled pair by pair, busiest first, priced by the
  cluster model (``timed.py``); the result carries that prediction.
* Without one, and for relay chains, rounds are filled first-fit in a fixed order
  (``first_fit.py``); chain hops go at least one round after the hop feeding them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..base import Transfer
from ..cluster import LinkModel, round_time
from ..config import PlanConfig
from ..pass4_routes import Routes
from .first_fit import schedule
from .timed import timed_schedule


@dataclass(frozen=True)
class Rounds:
    """Pass 5's result: the transfers of every round (relay hops of ``relay="domain"``
    runs are derived later, ``result/expand.py``); with a topology the refit time the
    cluster model predicts for them, and for time-budgeted rounds the budget each
    (GPU, link) kept to."""

    transfers: list[list[Transfer]]
    budget: float | None = None
    seconds: float | None = None

    def __str__(self) -> str:
        count = sum(len(ts) for ts in self.transfers)
        timed = "" if self.seconds is None else f", predicted {self.seconds * 1e3:.3f} ms"
        return f"Rounds: {len(self.transfers)} round(s), {count:,} transfer parts{timed}"


def plan_rounds(routes: Routes, config: PlanConfig) -> Rounds:
    """Pass 5 (module docstring): rounds of ``config.bucket_bytes``, timed when
    ``config.links`` is set."""
    bucket_bytes, links = config.bucket_bytes, config.links
    if routes.relay == "chain":
        placed = schedule(routes.direct, bucket_bytes, routes.hops, links)
        return Rounds(placed, None, None if links is None else predicted_seconds(placed, links))
    if links is None:
        return Rounds(schedule(routes.direct, bucket_bytes, members=routes.members))
    # what no schedule can beat with every carried transfer sent directly
    direct_floor = 0.0
    if routes.carried:
        direct_floor = max(routes.link_seconds(links, carried=False).values())
    timed = timed_schedule(
        routes.direct,
        bucket_bytes,
        links,
        routes.members,
        routes.chains,
        routes.carried,
        direct_floor,
    )
    return Rounds(timed.rounds, timed.budget, timed.seconds)


def predicted_seconds(rounds: list[list[Transfer]], links: LinkModel) -> float:
    """The cluster model's time (``cluster.round_time``) of rounds whose transfers each
    reach only their own receiver: one message per (sender, receiver) and round."""

    def link_of(src: int, dst: int) -> tuple[str, float]:
        link, seconds_per_byte = links.link(src, dst)
        return link, 1 / seconds_per_byte

    total = 0.0
    for transfers in rounds:
        pairs: dict[tuple[int, int], int] = defaultdict(int)
        for t in transfers:
            pairs[(t.src, t.dst)] += t.nbytes
        messages = [(src, dst, nbytes) for (src, dst), nbytes in pairs.items()]
        total += round_time(messages, link_of, links.latency)[0]
    return total
