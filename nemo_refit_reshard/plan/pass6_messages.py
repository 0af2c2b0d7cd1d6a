"""Pass 6, messages: one message per (sender, receiver, round), its transfers packed back
to back in a fixed order (``base.message_order``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import compress, groupby
from operator import itemgetter, methodcaller, not_

from .base import RELAY, Transfer, in_message_order, new_transfer, sizes_of


@dataclass(frozen=True)
class Message:
    """All transfers from ``src`` to ``dst`` in one round, packed back to back.

    Transfers are ordered by decreasing dtype size, so every transfer starts at a
    byte offset aligned to its own element size without padding, then by
    destination tensor and box.
    """

    round: int
    src: int
    dst: int
    transfers: tuple[Transfer, ...]

    @cached_property
    def nbytes(self) -> int:
        return sum(sizes_of(self.transfers))

    @cached_property
    def shared(self) -> Message | None:
        """What ``dst``'s replicas and relay run receive too (``result/expand.py``): every
        transfer except those into ``dst``'s relay buffer (``base.relay_tensor``), which only
        ``dst`` itself receives. ``None`` if that leaves nothing."""
        # (``is_relay`` of every destination tensor, in C: messages hold millions)
        relayed = list(map(_STARTS_RELAY, map(_DST_TENSOR, self.transfers)))
        if not any(relayed):
            return self
        keep = tuple(compress(self.transfers, map(not_, relayed)))
        return Message(self.round, self.src, self.dst, keep) if keep else None

    def forwarded(self, src: int, dst: int, round_index: int) -> Message:
        """This message's content sent on by ``src``, which received it, to ``dst``, a
        replica of ``src`` (same local boxes), in round ``round_index``."""
        # (src, dst, src_tensor, src_box) <- (src, dst, dst_tensor, dst_box); rest as is
        return Message(
            round_index,
            src,
            dst,
            tuple(new_transfer(Transfer, (src, dst, *t[4:6], *t[4:])) for t in self.transfers),
        )

    def to(self, dst: int) -> Message:
        """This message as sent to ``dst``, a replica of its receiver (same local boxes)."""
        if dst == self.dst:
            return self
        transfers = tuple(new_transfer(Transfer, (t[0], dst, *t[2:])) for t in self.transfers)
        return Message(self.round, self.src, dst, transfers)


_PAIR = itemgetter(0, 1)  # (sender, receiver)
_DST_TENSOR = itemgetter(4)
_STARTS_RELAY = methodcaller("startswith", RELAY)  # ``base.is_relay``


def round_messages(r: int, transfers: list[Transfer]) -> list[Message]:
    """One round's transfers as one message per (sender, receiver), in that order."""
    by_pair = groupby(sorted(transfers, key=_PAIR), key=_PAIR)  # (a stable sort: C keys)
    return [Message(r, src, dst, tuple(in_message_order(list(ts)))) for (src, dst), ts in by_pair]


@dataclass(frozen=True)
class Messages:
    """Pass 6's result: per round, one message per (sender, stored receiver), sorted by
    (sender, receiver)."""

    rounds: list[list[Message]]

    def __str__(self) -> str:
        count = sum(len(msgs) for msgs in self.rounds)
        transfers = sum(len(m.transfers) for msgs in self.rounds for m in msgs)
        return (
            f"Messages: {len(self.rounds)} round(s), {count:,} stored messages, "
            f"{transfers:,} transfers"
        )


def to_messages(rounds: list[list[Transfer]]) -> Messages:
    """Pass 6: every round's transfers as one message per (sender, receiver), sorted by
    (sender, receiver); inside a message by :func:`~.base.message_order`."""
    return Messages([round_messages(r, ts) for r, ts in enumerate(rounds)])
