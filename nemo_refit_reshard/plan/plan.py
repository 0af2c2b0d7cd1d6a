"""The refit plan: build, stats, fingerprint, JSON round trip.

``plan_refit`` turns the layouts of every training rank (sources) and every
inference rank (destinations) into rounds of messages such that every
non-padding element of every destination tensor is delivered exactly once,
from a source rank that holds it. Sources are refit-group ranks ``0..S-1``;
destination ``d`` is refit-group rank ``S + d``; transfers and messages name
refit-group ranks.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from ..layouts.base import Box, RankLayout
from ..spec.model import ModelSpec
from .balance import DTYPE_BYTES, LinkModel, Transfer, assign_senders
from .overlap import Need, PlanError, destination_needs, source_regions
from .relay import RELAY_MODES, chain_replicas
from .schedule import Message, coalesce, schedule

PLAN_VERSION = 1


@dataclass(frozen=True)
class PlanStats:
    bytes_sent: tuple[int, ...]  # per refit-group rank (sources, then destinations)
    bytes_received: tuple[int, ...]  # per refit-group rank
    total_bytes: int
    min_bytes: int  # sum of destination needs: the floor any refit must move
    baseline_bytes: int  # gather to one training rank + broadcast to every inference rank
    num_transfers: int
    num_messages: int
    num_rounds: int

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes_sent": list(self.bytes_sent),
            "bytes_received": list(self.bytes_received),
            "total_bytes": self.total_bytes,
            "min_bytes": self.min_bytes,
            "baseline_bytes": self.baseline_bytes,
            "num_transfers": self.num_transfers,
            "num_messages": self.num_messages,
            "num_rounds": self.num_rounds,
        }


TensorTable = tuple[dict[str, tuple[tuple[int, ...], str]], ...]


@dataclass(frozen=True)
class RefitPlan:
    """A deterministic transfer plan; ``fingerprint`` identifies its content."""

    model: str
    num_sources: int
    num_destinations: int
    bucket_bytes: int
    source_tensors: TensorTable  # per source rank: local name -> (shape, dtype) it sends from
    destination_tensors: TensorTable  # per destination rank: name -> (shape, dtype)
    rounds: tuple[tuple[Message, ...], ...]
    stats: PlanStats
    fingerprint: str = field(default="")

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    def expected_tensors(self, group_rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """The live tensors (name -> shape, dtype) this refit-group rank must hold."""
        if group_rank < self.num_sources:
            return self.source_tensors[group_rank]
        return self.destination_tensors[group_rank - self.num_sources]

    def messages_of(self, group_rank: int) -> list[Message]:
        """Every message this refit-group rank sends or receives, in round order."""
        return [m for msgs in self.rounds for m in msgs if group_rank in (m.src, m.dst)]

    # -- serialization (JSON, no pickle) ----------------------------------------------
    def _body(self) -> dict[str, Any]:
        def tensors(table: TensorTable) -> list[dict[str, Any]]:
            return [
                {name: [list(shape), dtype] for name, (shape, dtype) in sorted(rank.items())}
                for rank in table
            ]

        return {
            "version": PLAN_VERSION,
            "model": self.model,
            "num_sources": self.num_sources,
            "num_destinations": self.num_destinations,
            "bucket_bytes": self.bucket_bytes,
            "source_tensors": tensors(self.source_tensors),
            "destination_tensors": tensors(self.destination_tensors),
            "rounds": [[_message_json(m) for m in msgs] for msgs in self.rounds],
            "stats": self.stats.to_json(),
        }

    def to_json(self) -> str:
        return json.dumps({**self._body(), "fingerprint": self.fingerprint}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> RefitPlan:
        data = json.loads(text)
        if data.get("version") != PLAN_VERSION:
            raise PlanError(
                f"plan version {data.get('version')} is not {PLAN_VERSION}; rebuild the plan "
                "with this version of nemo-refit-reshard"
            )

        def tensors(rows: list[dict[str, Any]]) -> TensorTable:
            return tuple(
                {name: (tuple(shape), dtype) for name, (shape, dtype) in rank.items()}
                for rank in rows
            )

        rounds = tuple(
            tuple(_message_from_json(r, m) for m in msgs) for r, msgs in enumerate(data["rounds"])
        )
        s = data["stats"]
        plan = cls(
            model=data["model"],
            num_sources=data["num_sources"],
            num_destinations=data["num_destinations"],
            bucket_bytes=data["bucket_bytes"],
            source_tensors=tensors(data["source_tensors"]),
            destination_tensors=tensors(data["destination_tensors"]),
            rounds=rounds,
            stats=PlanStats(
                bytes_sent=tuple(s["bytes_sent"]),
                bytes_received=tuple(s["bytes_received"]),
                **{
                    k: s[k]
                    for k in (
                        "total_bytes",
                        "min_bytes",
                        "baseline_bytes",
                        "num_transfers",
                        "num_messages",
                        "num_rounds",
                    )
                },
            ),
            fingerprint=data["fingerprint"],
        )
        if _fingerprint(plan._body()) != plan.fingerprint:
            raise PlanError(
                "plan file content does not match its fingerprint (corrupted or edited)"
            )
        return plan


def _message_json(m: Message) -> dict[str, Any]:
    return {
        "src": m.src,
        "dst": m.dst,
        "t": [
            [
                t.src_tensor,
                *t.src_box.to_json(),
                t.dst_tensor,
                *t.dst_box.to_json(),
                t.canonical,
                *t.canonical_box.to_json(),
                t.dtype,
            ]
            for t in m.transfers
        ],
    }


def _message_from_json(round_index: int, data: dict[str, Any]) -> Message:
    src, dst = data["src"], data["dst"]
    transfers = tuple(
        Transfer(
            src,
            dst,
            row[0],
            Box(tuple(row[1]), tuple(row[2])),
            row[3],
            Box(tuple(row[4]), tuple(row[5])),
            row[6],
            Box(tuple(row[7]), tuple(row[8])),
            row[9],
        )
        for row in data["t"]
    )
    return Message(round_index, src, dst, transfers)


def _fingerprint(body: dict[str, Any]) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _needs_all(destinations: list[RankLayout], regions: dict, offset: int) -> list[Need]:
    """Needs of every destination (as refit-group ranks), computed once per replica class."""
    needs: list[Need] = []
    done: dict[int, list[Need]] = {}
    for layout in destinations:
        rep = min(layout.replicas)
        group_rank = offset + layout.rank
        if rep in done and rep != layout.rank:
            needs += [Need(group_rank, n.dst_piece, n.canonical_box, n.region) for n in done[rep]]
            continue
        own = destination_needs(layout, regions, group_rank)
        done[layout.rank] = own
        needs += own
    return needs


def _baseline_bytes(
    spec: ModelSpec,
    sources: list[RankLayout],
    destinations: list[RankLayout],
    dtype_of: dict[tuple[int, str], str],
) -> int:
    """Bytes of the gather-broadcast baseline (``plan/baseline.py``): each needed tensor
    gathered to the source rank holding most of it, then sent whole to every destination
    that needs any of it, all in the destination dtype."""
    held: dict[str, dict[int, int]] = {}
    for layout in sources:
        for p in layout.pieces():
            per = held.setdefault(p.canonical, {})
            per[layout.rank] = per.get(layout.rank, 0) + p.canonical_box.numel
    readers: dict[str, set[int]] = {}
    itemsize: dict[str, int] = {}
    for layout in destinations:
        for p in layout.pieces():
            readers.setdefault(p.canonical, set()).add(layout.rank)
            itemsize[p.canonical] = DTYPE_BYTES[dtype_of[(len(sources) + layout.rank, p.local)]]
    total = 0
    for name, ranks in readers.items():
        t = spec.tensor(name)
        root_share = max(held.get(name, {0: 0}).values())
        gather = (t.numel - root_share) * itemsize[name]
        total += gather + t.numel * itemsize[name] * len(ranks)
    return total


def check_specs_match(source: ModelSpec, destination: ModelSpec) -> None:
    """Both sides must describe the same canonical tensors (names and shapes)."""
    problems = []
    src = {t.name: t.shape for t in source}
    dst = {t.name: t.shape for t in destination}
    for name in sorted(set(dst) - set(src)):
        problems.append(f"{name}: only in the destination spec")
    for name in sorted(set(src) - set(dst)):
        problems.append(f"{name}: only in the source spec")
    for name in sorted(set(src) & set(dst)):
        if src[name] != dst[name]:
            problems.append(
                f"{name}: source shape {list(src[name])} != destination {list(dst[name])}"
            )
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise PlanError(
            f"source spec {source.name!r} and destination spec {destination.name!r} disagree "
            f"on {len(problems)} tensor(s):\n  {shown}{more}"
        )


def plan_refit(
    spec: ModelSpec,
    sources: list[RankLayout],
    destinations: list[RankLayout],
    bucket_mb: float = 512,
    destination_spec: ModelSpec | None = None,
    relay: str = "none",
    links: LinkModel | None = None,
) -> RefitPlan:
    """Build the transfer plan from every source layout to every destination layout.

    ``relay="chain"`` forwards a box that one training rank would send to several
    inference replicas along a chain of those replicas (``plan/relay.py``).
    ``links`` (a topology, ``plan/topology.py``) makes replica choice minimise
    predicted link busy time instead of bytes per sender.
    """
    if relay not in RELAY_MODES:
        raise PlanError(f"unknown relay mode {relay!r}; choose one of {RELAY_MODES}")
    if destination_spec is not None:
        check_specs_match(spec, destination_spec)
    if [lay.rank for lay in sources] != list(range(len(sources))):
        raise PlanError("source layouts must be given for ranks 0..S-1 in order")
    if [lay.rank for lay in destinations] != list(range(len(destinations))):
        raise PlanError("destination layouts must be given for ranks 0..D-1 in order")
    bucket_bytes = int(bucket_mb * 2**20)
    regions = source_regions(spec, sources)
    s = len(sources)
    dtype_of = {(s + lay.rank, t.name): t.dtype for lay in destinations for t in lay.tensors}
    needs = _needs_all(destinations, regions, s)
    transfers = coalesce(assign_senders(needs, dtype_of, links))
    if relay == "chain":
        direct, *forwarded = chain_replicas(transfers, links)
        rounds = schedule(direct, bucket_bytes, forwarded, links)
    else:
        rounds = schedule(transfers, bucket_bytes, links=links)

    sent = [0] * (s + len(destinations))
    received = [0] * (s + len(destinations))
    used_src: list[set[str]] = [set() for _ in sources]
    for messages in rounds:
        for m in messages:
            sent[m.src] += m.nbytes
            received[m.dst] += m.nbytes
            if m.src < s:
                used_src[m.src].update(t.src_tensor for t in m.transfers)
    min_bytes = sum(
        p.canonical_box.numel * DTYPE_BYTES[t.dtype]
        for lay in destinations
        for t in lay.tensors
        for p in t.pieces
    )
    stats = PlanStats(
        bytes_sent=tuple(sent),
        bytes_received=tuple(received),
        total_bytes=sum(sent),
        min_bytes=min_bytes,
        baseline_bytes=_baseline_bytes(spec, sources, destinations, dtype_of),
        num_transfers=sum(len(m.transfers) for msgs in rounds for m in msgs),
        num_messages=sum(len(msgs) for msgs in rounds),
        num_rounds=len(rounds),
    )
    plan = RefitPlan(
        model=spec.name,
        num_sources=len(sources),
        num_destinations=len(destinations),
        bucket_bytes=bucket_bytes,
        source_tensors=tuple(
            {t.name: (t.shape, t.dtype) for t in lay.tensors if t.name in used_src[lay.rank]}
            for lay in sources
        ),
        destination_tensors=tuple(
            {t.name: (t.shape, t.dtype) for t in lay.tensors if t.pieces} for lay in destinations
        ),
        rounds=tuple(tuple(msgs) for msgs in rounds),
        stats=stats,
    )
    object.__setattr__(plan, "fingerprint", _fingerprint(plan._body()))
    return plan
