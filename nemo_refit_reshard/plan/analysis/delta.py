"""Predicted delta refit of a plan (issue 42; ``docs/delta.md``): each message of the
static plan sent in its smallest form, at an assumed update density.

Size of one message (the single source of truth for predictions; the engine's codec,
``engine/delta/codec.py``, is written separately and tested against it). A message of
``n`` bytes compares in *units* of ``u`` bytes (``u`` = the smallest itemsize of its
transfers' dtypes), ``N = n / u`` units, ``k`` of them changed::

    w            = 1 if N <= 256, 2 if N <= 65536, else 4   (bytes of one position)
    e            = round(k (1 - k/N)^255)                   (gaps past 255 units)
    payload(n,k) = min(n, k (w + u), ceil(N / 8) + k u,     (dense, positions, bitmap,
                       k (u + 1) + 4 e)                      gaps)
    wire(n, k)   = 32 + payload(n, k)                       (a 32-byte header first)

``e`` is the expected count of gaps longer than 255 units when the ``k`` changes fall
independently at density ``k/N`` (a gap is longer with probability ``(1 - k/N)^255``);
the engine counts its own.

At density ``D`` a message has ``k = F + round(D (N - F))`` changed units, ``F`` its
*fixed* units: bytes its receiver cannot re-pack from live tensors (a relay buffer's,
an FP8 engine's BF16 shadows), sent every step (``F = 0`` in a BF16 plan without
relay buffers, so ``k = round(D N)``; ``round`` is Python's, halves to even). An
inference rank that forwards (relay runs and chains) sends deltas too, from baselines
it keeps in host memory: its messages to one receiver in one round as one message.

Time. Rounds run one after another, each in four serial steps::

    T_r = max_g S_r(g) / hbm + round_time(headers_r) + round_time(payloads_r)
          + max_g R_r(g) / hbm

``round_time`` is the cluster model's (``cluster.round_time``): the headers are one
32-byte message per message of the round (one more latency per message and link),
the payloads the non-empty ones (``k = 0`` sends a header only). Memory traffic at
the GPU's HBM bandwidth, as the engine does it: a sender compares and encodes each
*distinct* outgoing message once (``S += 2 n + payload + k u``: read the staging and
the baseline, write the payload, write the ``k`` changed units back into the
baseline); a receiver of a non-dense payload writes the changed units straight into
its live tensors (``R += payload + k u + 2 F``: read the payload, scatter ``k`` units,
and patch and unpack its fixed bytes).

Memory. A training rank keeps one baseline per distinct outgoing message of each round
(identical messages to several replicas share one: ``engine/program.py``'s
``_layout_round`` key, the transfers' ``(src_tensor, src_box, dtype)``), so its bytes
are the sum of ``n`` over them; a message whose bytes are all fixed keeps none.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..base import DTYPE_BYTES, is_relay
from ..cluster import Topology, round_time
from ..pass6_messages import Message
from ..result.expand import Expansion
from ..result.refit_plan import RefitPlan
from .predict import Prediction, predict_refit

HEADER_BYTES = 32
MAX_GAP = 255  # the longest gap one byte of a GAPS payload holds
# Full passes over a message's n bytes: a sender's compare (staging and baseline read);
# a receiver writes only changed units (engine/delta/rounds.place), no full pass
SENDER_PASSES, RECEIVER_PASSES = 2, 0
DEFAULT_HBM_GBPS = 3350.0  # H100 SXM (HBM3); GB/s = 10**9 bytes/s


def position_width(units: int) -> int:
    """Bytes of one position: the narrowest of 1, 2, 4 that holds ``units - 1``."""
    if units <= 256:
        return 1
    return 2 if units <= 65536 else 4


def long_gaps(units: int, changed: int) -> int:
    """``round(k (1 - k/N)^255)``: gaps past 255 units among ``k`` changes spread
    independently over ``N`` units."""
    return round(changed * (1 - changed / units) ** MAX_GAP) if units else 0


def payload_bytes(nbytes: int, unit: int, changed: int) -> int:
    """``min(n, k (w + u), ceil(N / 8) + k u, k (u + 1) + 4 e)``: the smallest form's
    payload."""
    units = nbytes // unit
    positions = changed * (position_width(units) + unit)
    bitmap = -(-units // 8) + changed * unit
    gaps = changed * (unit + 1) + 4 * long_gaps(units, changed)
    return min(nbytes, positions, bitmap, gaps)


def wire_bytes(nbytes: int, unit: int, changed: int) -> int:
    """A message's bytes on the wire: its 32-byte header and its payload."""
    return HEADER_BYTES + payload_bytes(nbytes, unit, changed)


def changed_units(units: int, fixed: int, density: float) -> int:
    """``k = F + round(D (N - F))``: the fixed units plus ``D`` of the others."""
    return fixed + round(density * (units - fixed))


@dataclass(frozen=True)
class WireMessage:
    """One message of the expanded plan as the delta refit sees it. ``key`` names its
    content among its sender's messages of the round (a forwarder's: its receiver);
    ``fixed`` is in bytes."""

    src: int
    dst: int
    nbytes: int
    unit: int
    fixed: int
    key: tuple | None


def wire_messages(plan: RefitPlan) -> list[list[WireMessage]]:
    """Per round, every message of the plan (replicas and relay runs expanded, as
    ``RefitPlan.traffic``), with its unit, fixed bytes and content key."""
    expansion = Expansion(plan.class_rounds, plan.replica_groups, plan.relay_chains)
    shadows = _shadow_test(plan)
    forwarded: dict[tuple[int, int, int], list[int]] = {}  # (round, src, dst) -> [n, u, F]
    out: list[list[WireMessage]] = [[] for _ in range(expansion.num_rounds)]
    for msgs in plan.class_rounds:
        for m in msgs:
            described: dict[bool, tuple[int, int, tuple]] = {}
            for r, src, dst, fwd in expansion.deliveries(m):
                if src >= plan.num_sources:  # a forwarder: one message per pair and round
                    unit, fixed, _ = _describe(
                        m if dst == m.dst else m.shared, dst == m.dst, dst, shadows
                    )  # type: ignore[arg-type]
                    acc = forwarded.setdefault((r, src, dst), [0, unit, 0])
                    acc[0] += expansion.size(m, dst, fwd)
                    acc[1], acc[2] = min(acc[1], unit), acc[2] + fixed
                    continue
                whole = dst == m.dst
                if whole not in described:
                    content = m if whole else m.shared
                    described[whole] = _describe(content, whole, dst, shadows)  # type: ignore[arg-type]
                unit, fixed, key = described[whole]
                nbytes = expansion.size(m, dst, False)
                out[r].append(WireMessage(src, dst, nbytes, unit, fixed, key))
    for (r, src, dst), (nbytes, unit, fixed) in forwarded.items():
        out[r].append(WireMessage(src, dst, nbytes, unit, fixed, ("forwarded to", dst)))
    return out


def _shadow_test(plan: RefitPlan):
    """``(dst, tensor, dtype) -> bool``: the transfer lands in a tensor of another dtype
    (an FP8 engine's weight fed BF16 shadows), which its receiver cannot re-pack."""
    if plan.fp8_block is None or not plan.destination_tensors:
        return None
    tables, first = plan.destination_tensors, plan.num_sources

    def differs(dst: int, tensor: str, dtype: str) -> bool:
        held = tables[dst - first].get(tensor)
        return held is not None and held[1] != dtype

    return differs


def _describe(m: Message, whole: bool, dst: int, shadows) -> tuple[int, int, tuple]:
    """``(unit, fixed bytes, content key)`` of a training rank's message. Relay-buffer
    transfers only reach the stored receiver (``whole``); replicas share the rest."""
    unit = min(DTYPE_BYTES[t.dtype] for t in m.transfers)
    fixed = 0
    for t in m.transfers:
        if (whole and is_relay(t.dst_tensor)) or (shadows and shadows(dst, t.dst_tensor, t.dtype)):
            fixed += t.nbytes
    key = tuple((t.src_tensor, t.src_box, t.dtype) for t in m.transfers)
    return unit, fixed, key


@dataclass(frozen=True)
class DeltaPrediction:
    """A delta refit's figures at one density, beside the dense plan's."""

    density: float
    hbm_gbps: float
    messages: int
    dense_bytes: int  # the plan's bytes per step (no headers)
    dense_busiest_bytes: int  # max over ranks of bytes sent or received, dense
    dense_seconds: float  # predict_refit
    delta_bytes: int  # headers + payloads
    delta_busiest_bytes: int
    delta_seconds: float
    wire_seconds: float  # of delta_seconds: headers and payloads
    memory_seconds: float  # of delta_seconds: compare/encode and apply
    baseline_bytes: tuple[int, ...]  # per refit-group rank

    @property
    def ratio(self) -> float | None:
        """Predicted delta time / dense time."""
        return self.delta_seconds / self.dense_seconds if self.dense_seconds else None

    def to_json(self) -> dict[str, Any]:
        return {
            "density": self.density,
            "hbm_gbps": self.hbm_gbps,
            "messages": self.messages,
            "dense_bytes": self.dense_bytes,
            "dense_busiest_rank_bytes": self.dense_busiest_bytes,
            "dense_s": self.dense_seconds,
            "delta_bytes": self.delta_bytes,
            "delta_busiest_rank_bytes": self.delta_busiest_bytes,
            "delta_s": self.delta_seconds,
            "delta_wire_s": self.wire_seconds,
            "delta_memory_s": self.memory_seconds,
            "delta_over_dense": self.ratio,
            "baseline_bytes_max": max(self.baseline_bytes, default=0),
        }


def baseline_memory(plan: RefitPlan, rounds: list[list[WireMessage]] | None = None) -> list[int]:
    """Bytes of baselines per refit-group rank: per round, the sum of ``n`` over the
    rank's distinct outgoing messages that are not all fixed."""
    rounds = wire_messages(plan) if rounds is None else rounds
    held = [0] * (plan.num_sources + plan.num_destinations)
    for msgs in rounds:
        seen: set[tuple[int, tuple]] = set()
        for w in msgs:
            if w.key is None or w.fixed >= w.nbytes or (w.src, w.key) in seen:
                continue
            seen.add((w.src, w.key))
            held[w.src] += w.nbytes
    return held


def predict_delta(
    plan: RefitPlan,
    topology: Topology,
    density: float,
    hbm_gbps: float = DEFAULT_HBM_GBPS,
    dense: Prediction | None = None,
) -> DeltaPrediction:
    """The delta refit of ``plan`` at ``density`` on ``topology`` (module docstring),
    beside the dense one (``dense``: ``predict_refit``'s, computed when not given)."""
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"delta density {density} must be a fraction in [0, 1]")
    if not hbm_gbps > 0:
        raise ValueError(f"HBM bandwidth {hbm_gbps} GB/s must be > 0")
    topology.check_ranks(plan.num_sources, plan.num_destinations)
    dense = dense if dense is not None else predict_refit(plan, topology)
    hbm = hbm_gbps * 1e9
    rounds = wire_messages(plan)
    world = plan.num_sources + plan.num_destinations
    sent, received = [0] * world, [0] * world
    wire_s = memory_s = 0.0
    count = 0
    for msgs in rounds:
        headers, payloads = [], []
        send_mem: dict[int, int] = defaultdict(int)
        recv_mem: dict[int, int] = defaultdict(int)
        compared: set[tuple[int, tuple]] = set()
        encoded: set[tuple[int, tuple, int]] = set()
        for w in msgs:
            units = w.nbytes // w.unit
            k = changed_units(units, w.fixed // w.unit, density)
            payload = w.nbytes if w.key is None else payload_bytes(w.nbytes, w.unit, k)
            count += 1
            sent[w.src] += HEADER_BYTES + payload
            received[w.dst] += HEADER_BYTES + payload
            headers.append((w.src, w.dst, HEADER_BYTES))
            if payload:
                payloads.append((w.src, w.dst, payload))
            if w.key is None or w.fixed >= w.nbytes:
                continue
            if (w.src, w.key) not in compared:
                compared.add((w.src, w.key))
                send_mem[w.src] += SENDER_PASSES * w.nbytes + k * w.unit
            if (w.src, w.key, w.fixed) not in encoded and payload < w.nbytes:
                encoded.add((w.src, w.key, w.fixed))
                send_mem[w.src] += payload
            if payload < w.nbytes:
                recv_mem[w.dst] += RECEIVER_PASSES * w.nbytes + payload + k * w.unit
                recv_mem[w.dst] += 2 * w.fixed
        wire_s += _round_time(headers, topology) + _round_time(payloads, topology)
        memory_s += (max(send_mem.values(), default=0) + max(recv_mem.values(), default=0)) / hbm
    gb = dense.gpu_bytes
    return DeltaPrediction(
        density=density,
        hbm_gbps=hbm_gbps,
        messages=count,
        dense_bytes=sum(g.sent_nvlink + g.sent_nic for g in gb),
        dense_busiest_bytes=max(
            (max(g.sent_nvlink + g.sent_nic, g.received_nvlink + g.received_nic) for g in gb),
            default=0,
        ),
        dense_seconds=dense.seconds,
        delta_bytes=sum(sent),
        delta_busiest_bytes=max(map(max, sent, received), default=0),
        delta_seconds=wire_s + memory_s,
        wire_seconds=wire_s,
        memory_seconds=memory_s,
        baseline_bytes=tuple(baseline_memory(plan, rounds)),
    )


def _round_time(messages: Iterable[tuple[int, int, int]], topology: Topology) -> float:
    return round_time(messages, topology.link_rate, topology.latency)[0]
