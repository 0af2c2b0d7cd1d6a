"""From a stored plan to every rank's messages.

A plan stores one message per (sender, receiver, round), where the receiver
stands for a replica group (``plan_refit`` plans identical inference replicas
once). Expanding a stored message ``m`` (class round ``r``) gives every message
that carries its content:

* each member of the receiver's replica group gets ``m`` in round ``r``;
* with ``relay="domain"`` the group's members come in *runs* (members sharing
  an NVLink domain, ``relay_chains``). ``m`` enters each run at position
  ``j = m.entry mod w`` (``w`` the run's width) and is forwarded around the run,
  one hop per round: in round ``r + k`` member ``j+k-1`` sends it to member
  ``j+k`` (positions mod ``w``), ``k = 1 .. w-1``. Stored messages of one round
  are spread over entry positions, so every member's NIC brings in a share.

Several stored messages can expand onto one (round, sender, receiver) pair
(hops carry what several training ranks delivered); they merge into one
message, as the engine exchanges one message per pair and round.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence

from .schedule import Message, message_order


class Expansion:
    """Index over a plan's stored rounds, replica groups and relay runs."""

    def __init__(
        self,
        class_rounds: Sequence[Sequence[Message]],
        replica_groups: Sequence[tuple[int, ...]],
        relay_chains: Sequence[tuple[int, ...]],
    ) -> None:
        self.class_rounds = class_rounds
        self.members = {g[0]: g for g in replica_groups}
        self.stored_as = {m: g[0] for g in replica_groups for m in g}
        self.run_of = {c[0]: c for c in relay_chains}
        self.position = {m: (c, i) for c in relay_chains for i, m in enumerate(c)}
        self.lag = max((len(c) for c in relay_chains), default=1) - 1
        self.by_src: dict[int, list[Message]] = defaultdict(list)
        self.into: dict[int, list[Message]] = defaultdict(list)
        for msgs in class_rounds:
            for m in msgs:
                self.by_src[m.src].append(m)
                self.into[m.dst].append(m)

    @property
    def num_rounds(self) -> int:
        return len(self.class_rounds) + self.lag if self.class_rounds else 0

    def runs(self, stored: int) -> list[tuple[int, ...]]:
        return [self.run_of.get(h, (h,)) for h in self.members.get(stored, (stored,))]

    def deliveries(self, m: Message) -> Iterator[tuple[int, int, int, bool]]:
        """``(round, src, dst, forwarded)`` of every message carrying ``m``'s content."""
        for run in self.runs(m.dst):
            w = len(run)
            j = m.entry % w
            yield m.round, m.src, run[j], False
            for k in range(1, w):
                yield m.round + k, run[(j + k - 1) % w], run[(j + k) % w], True

    def all_messages(self) -> list[list[Message]]:
        """Every rank's messages per round, sorted by (sender, receiver)."""
        parts: dict[tuple[int, int, int], list[tuple[Message, bool]]] = defaultdict(list)
        for msgs in self.class_rounds:
            for m in msgs:
                for r, src, dst, fwd in self.deliveries(m):
                    parts[(r, src, dst)].append((m, fwd))
        out: list[list[Message]] = [[] for _ in range(self.num_rounds)]
        for key in sorted(parts):
            out[key[0]].append(_merge(*key, parts[key]))
        return out

    def traffic(self) -> list[list[tuple[int, int, int]]]:
        """Per round, ``(src, dst, bytes)`` of every (merged) message."""
        sizes: dict[tuple[int, int, int], int] = defaultdict(int)
        for msgs in self.class_rounds:
            for m in msgs:
                for r, src, dst, _ in self.deliveries(m):
                    sizes[(r, src, dst)] += m.nbytes
        out: list[list[tuple[int, int, int]]] = [[] for _ in range(self.num_rounds)]
        for (r, src, dst), nbytes in sizes.items():
            out[r].append((src, dst, nbytes))
        return out

    def messages_of(self, rank: int) -> list[Message]:
        """The messages ``rank`` sends or receives, merged, in round order."""
        parts: dict[tuple[int, int, int], list[tuple[Message, bool]]] = defaultdict(list)
        for m in self.by_src.get(rank, ()):  # training ranks (and explicit relay hops)
            for r, src, dst, fwd in self.deliveries(m):
                if src == rank:
                    parts[(r, src, dst)].append((m, fwd))
        run, i = self.position.get(rank, ((rank,), 0))
        stored = self.stored_as.get(run[0], run[0])
        w = len(run)
        for m in self.into.get(stored, ()):
            j = m.entry % w
            if i == j:
                parts[(m.round, m.src, rank)].append((m, False))
            k = (i - j) % w
            if k:
                parts[(m.round + k, run[i - 1], rank)].append((m, True))
            k = (i + 1 - j) % w
            if k and w > 1:
                parts[(m.round + k, rank, run[(i + 1) % w])].append((m, True))
        return [_merge(*key, parts[key]) for key in sorted(parts)]


def _merge(r: int, src: int, dst: int, parts: list[tuple[Message, bool]]) -> Message:
    if len(parts) == 1:
        m, fwd = parts[0]
        return m.forwarded(src, dst, r) if fwd else m.to(dst)
    transfers = [
        t for m, fwd in parts for t in (m.forwarded(src, dst, r) if fwd else m.to(dst)).transfers
    ]
    return Message(r, src, dst, tuple(sorted(transfers, key=message_order)))
