"""Plan serialisation helpers: messages as compact JSON rows, and the fingerprint.

A transfer is one row ``[src tensor, src offsets, src sizes, dst tensor, dst
offsets, dst sizes, canonical, canonical offsets, canonical sizes, dtype]``;
the message carries ``src`` and ``dst`` once for all its rows.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ...layouts.base import Box
from ..base import Transfer
from ..pass6_messages import Message


class NameTable:
    """Tensor names stored once, rows refer to them by index: a DeepSeek-V3 plan names
    each tensor thousands of times, and the names were most of its JSON."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.names: list[str] = []

    def __call__(self, name: str) -> int:
        i = self.index.get(name)
        if i is None:
            i = self.index[name] = len(self.names)
            self.names.append(name)
        return i


def message_json(m: Message, names: NameTable) -> dict[str, Any]:
    # Tuples, not lists: json encodes them as arrays without building a list per box.
    return {
        "src": m.src,
        "dst": m.dst,
        "t": [
            (
                names(t.src_tensor),
                t.src_box.offsets,
                t.src_box.sizes,
                names(t.dst_tensor),
                t.dst_box.offsets,
                t.dst_box.sizes,
                names(t.canonical),
                t.canonical_box.offsets,
                t.canonical_box.sizes,
                t.dtype,
            )
            for t in m.transfers
        ],
    }


def message_from_json(
    round_index: int,
    data: dict[str, Any],
    names: list[str],
    boxes: dict[tuple, Box] | None = None,
) -> Message:
    """A message from its JSON form. ``boxes`` (shared across one plan's messages)
    reuses equal boxes: an inference rank's slice names the same few expert boxes
    tens of thousands of times, and building each anew was half its load time."""
    src, dst = data["src"], data["dst"]
    cache: dict[tuple, Box] = {} if boxes is None else boxes

    def box(offsets: list[int], sizes: list[int]) -> Box:
        key = (*offsets, -1, *sizes)
        b = cache.get(key)
        if b is None:
            b = cache[key] = Box(tuple(offsets), tuple(sizes))
        return b

    transfers = tuple(
        Transfer(
            src,
            dst,
            names[row[0]],
            box(row[1], row[2]),
            names[row[3]],
            box(row[4], row[5]),
            names[row[6]],
            box(row[7], row[8]),
            row[9],
        )
        for row in data["t"]
    )
    return Message(round_index, src, dst, transfers)


def compact_json(body: dict[str, Any]) -> str:
    return json.dumps(body, separators=(",", ":"))


def fingerprint_of(text: str) -> str:
    """First 16 hex digits of the SHA-256 of a plan body's compact JSON."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]
