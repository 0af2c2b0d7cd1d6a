"""Plan serialisation helpers: messages as compact JSON rows, and the fingerprint.

A transfer is one row ``[src tensor, src offsets, src sizes, dst tensor, dst
offsets, dst sizes, canonical, canonical offsets, canonical sizes, dtype]``;
the message carries ``src`` and ``dst`` once for all its rows.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
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


def rounds_text(class_rounds: Sequence[Sequence[Message]], names: NameTable) -> str:
    """``compact_json([[message_json(m, names) for m in msgs] for msgs in class_rounds])``,
    the same text written directly: a DeepSeek-V3 plan has 1.5 million rows, and json's
    encoder walking a tuple per row (and a tuple per box) took most of its fingerprint.
    Boxes, names and dtypes recur, so their text is made once (each a non-empty string:
    ``get(x) or make(x)`` looks it up in C and makes it only when missing)."""
    texts: dict[object, str] = {}  # offsets or sizes -> JSON array; dtype -> JSON string
    indices: dict[str, str] = {}  # tensor name -> its index in ``names``, as text

    def array(values: tuple[int, ...]) -> str:
        text = texts[values] = "[" + ",".join(map(str, values)) + "]"
        return text

    def index(name: str) -> str:
        text = indices[name] = str(names(name))
        return text

    def string(value: str) -> str:
        text = texts[value] = json.dumps(value)
        return text

    text, name = texts.get, indices.get

    def row(t: Transfer) -> str:
        src, dst, canonical = t.src_box, t.dst_box, t.canonical_box
        so, ss, do, ds = src.offsets, src.sizes, dst.offsets, dst.sizes
        co, cs = canonical.offsets, canonical.sizes
        s_name, d_name, c_name = t.src_tensor, t.dst_tensor, t.canonical
        return (
            f"[{name(s_name) or index(s_name)},{text(so) or array(so)},"
            f"{text(ss) or array(ss)},{name(d_name) or index(d_name)},"
            f"{text(do) or array(do)},{text(ds) or array(ds)},"
            f"{name(c_name) or index(c_name)},{text(co) or array(co)},"
            f"{text(cs) or array(cs)},{text(t.dtype) or string(t.dtype)}]"
        )

    def message(m: Message) -> str:
        return f'{{"src":{m.src},"dst":{m.dst},"t":[{",".join(map(row, m.transfers))}]}}'

    return "[" + ",".join("[" + ",".join(map(message, msgs)) + "]" for msgs in class_rounds) + "]"


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
