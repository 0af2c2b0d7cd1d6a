"""From a stored plan to every rank's messages.

A plan stores one message per (sender, receiver, round), where the receiver
stands for a replica group (``plan_refit`` plans identical inference replicas
once). Expanding a stored message ``m`` (class round ``r``) gives every message
that carries its content:

* each member of the receiver's replica group gets ``m`` in round ``r``;
* with ``relay="domain"`` the group's members come in *runs* (members sharing
  an NVLink domain, ``relay_chains``), and the stored receiver and its
  counterparts sit at some position ``p`` of their runs (``pass4_routes/domain.py``
  spreads positions so each member's NIC brings in a share). The message is
  then forwarded around each run, one hop per round: in round ``r + k`` the
  member at ``p+k-1`` sends it to the member at ``p+k`` (mod the run's width
  ``w``), ``k = 1 .. w-1``.

Several stored messages can expand onto one (round, sender, receiver) pair
(hops carry what several training ranks delivered); they merge into one
message, as the engine exchanges one message per pair and round.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from functools import cached_property

from ..base import in_message_order
from ..pass6_messages import Message


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
        self.position = {m: (c, i) for c in relay_chains for i, m in enumerate(c)}
        self.lag = max((len(c) for c in relay_chains), default=1) - 1
        self.by_src: dict[int, list[Message]] = defaultdict(list)
        for msgs in class_rounds:
            for m in msgs:
                self.by_src[m.src].append(m)

    @property
    def num_rounds(self) -> int:
        return len(self.class_rounds) + self.lag if self.class_rounds else 0

    def deliveries(self, m: Message) -> Iterator[tuple[int, int, int, bool]]:
        """``(round, src, dst, forwarded)`` of every message carrying ``m``'s content:
        all of it to ``m.dst``, its shared part (:attr:`Message.shared`) to the other
        replicas and along relay runs."""
        shared = m.shared
        for x in self.members.get(m.dst, (m.dst,)):
            if shared is None and x != m.dst:
                continue
            yield m.round, m.src, x, False
            if shared is None:
                continue
            run, p = self.position.get(x, ((x,), 0))
            w = len(run)
            for k in range(1, w):
                yield m.round + k, run[(p + k - 1) % w], run[(p + k) % w], True

    @staticmethod
    def size(m: Message, dst: int, forwarded: bool) -> int:
        """Bytes of ``m``'s content that a delivery to ``dst`` carries."""
        if not forwarded and dst == m.dst:
            return m.nbytes
        shared = m.shared
        return shared.nbytes if shared is not None else 0

    @cached_property
    def into_run(self) -> dict[int, list[tuple[Message, int]]]:
        """Per run (keyed by its first member): stored messages entering it, and where."""
        out: dict[int, list[tuple[Message, int]]] = defaultdict(list)
        for msgs in self.class_rounds:
            for m in msgs:
                for x in self.members.get(m.dst, (m.dst,)):
                    run, p = self.position.get(x, ((x,), 0))
                    out[run[0]].append((m, p))
        return out

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
                for r, src, dst, fwd in self.deliveries(m):
                    sizes[(r, src, dst)] += self.size(m, dst, fwd)
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
        w = len(run)
        for m, p in self.into_run.get(run[0], ()):
            if m.shared is None and rank != m.dst:
                continue
            if i == p:
                parts[(m.round, m.src, rank)].append((m, False))
            if m.shared is None:
                continue
            k = (i - p) % w
            if k:
                parts[(m.round + k, run[i - 1], rank)].append((m, True))
            k = (i + 1 - p) % w
            if k:
                parts[(m.round + k, rank, run[(i + 1) % w])].append((m, True))
        return [_merge(*key, parts[key]) for key in sorted(parts)]


def _content(m: Message, r: int, src: int, dst: int, forwarded: bool) -> Message:
    """What one delivery of ``m`` carries (see :meth:`Expansion.deliveries`)."""
    if forwarded:
        return m.shared.forwarded(src, dst, r)  # type: ignore[union-attr]
    if dst == m.dst:
        return m
    return m.shared.to(dst)  # type: ignore[union-attr]


def _merge(r: int, src: int, dst: int, parts: list[tuple[Message, bool]]) -> Message:
    if len(parts) == 1:
        m, fwd = parts[0]
        return _content(m, r, src, dst, fwd)
    transfers = [t for m, fwd in parts for t in _content(m, r, src, dst, fwd).transfers]
    return Message(r, src, dst, tuple(in_message_order(transfers)))
