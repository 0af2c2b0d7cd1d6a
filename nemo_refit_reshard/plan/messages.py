"""Pass 6, messages: one message per (sender, receiver, round), its transfers packed back
to back in a fixed order."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property

from .carry import is_relay
from .transfer import DTYPE_BYTES, Transfer


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
        return sum(t.nbytes for t in self.transfers)

    @cached_property
    def shared(self) -> Message | None:
        """What ``dst``'s replicas and relay run receive too (``plan/expand.py``): every
        transfer except those into ``dst``'s relay buffer (``plan/carry.py``), which only
        ``dst`` itself receives. ``None`` if that leaves nothing."""
        keep = tuple(t for t in self.transfers if not is_relay(t.dst_tensor))
        if len(keep) == len(self.transfers):
            return self
        return Message(self.round, self.src, self.dst, keep) if keep else None

    def forwarded(self, src: int, dst: int, round_index: int) -> Message:
        """This message's content sent on by ``src``, which received it, to ``dst``, a
        replica of ``src`` (same local boxes), in round ``round_index``."""
        # (src, dst, src_tensor, src_box) <- (src, dst, dst_tensor, dst_box); rest as is
        return Message(
            round_index,
            src,
            dst,
            tuple(Transfer(src, dst, *t[4:6], *t[4:]) for t in self.transfers),
        )

    def to(self, dst: int) -> Message:
        """This message as sent to ``dst``, a replica of its receiver (same local boxes)."""
        if dst == self.dst:
            return self
        transfers = tuple(Transfer(t[0], dst, *t[2:]) for t in self.transfers)
        return Message(self.round, self.src, dst, transfers)


def message_order(t: Transfer) -> tuple:
    # Largest dtype first (alignment), then destination order, so the receiver's adjacent
    # boxes (e.g. consecutive experts of w13_weight) sit next to each other and merge.
    return (-DTYPE_BYTES[t.dtype], t.dst_tensor, t.dst_box.offsets, t.src_tensor, t.src_box.offsets)


def round_messages(r: int, transfers: list[Transfer]) -> list[Message]:
    """One round's transfers as one message per (sender, receiver), in that order."""
    pairs: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
    for t in transfers:
        pairs[(t.src, t.dst)].append(t)
    return [
        Message(r, src, dst, tuple(sorted(ts, key=message_order)))
        for (src, dst), ts in sorted(pairs.items())
    ]


def to_messages(rounds: list[list[Transfer]]) -> list[list[Message]]:
    """Pass 6: every round's transfers as one message per (sender, receiver), sorted by
    (sender, receiver); inside a message by :func:`message_order`."""
    return [round_messages(r, ts) for r, ts in enumerate(rounds)]
