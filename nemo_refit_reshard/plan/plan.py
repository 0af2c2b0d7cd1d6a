"""The refit plan: build, stats, fingerprint, JSON round trip.

``plan_refit`` turns the layouts of every training rank (sources) and every
inference rank (destinations) into rounds of messages such that every
non-padding element of every destination tensor is delivered exactly once,
from a source rank that holds it. Sources are refit-group ranks ``0..S-1``;
destination ``d`` is refit-group rank ``S + d``; transfers and messages name
refit-group ranks.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..layouts.base import Box, RankLayout, paused_gc
from ..spec.model import ModelSpec
from .balance import DTYPE_BYTES, LinkModel, Transfer, assign_senders
from .carry import choose_carriers, choose_ingress_carriers
from .domain import domain_entries, domain_groups
from .expand import Expansion
from .overlap import Need, PlanError, destination_needs, source_regions
from .relay import RELAY_MODES, chain_replicas
from .schedule import Message, coalesce, schedule
from .serialize import NameTable, compact_json, fingerprint_of, message_from_json, message_json
from .timed import timed_schedule

PLAN_VERSION = 2


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
    """A deterministic transfer plan; ``fingerprint`` identifies its content.

    Inference replicas hold identical layouts, so they receive identical
    messages from the same senders in the same rounds. The plan stores them
    once: ``class_rounds`` names only the first rank of each replica group in
    ``replica_groups`` (``(first, *others)``; destinations in no group stand
    for themselves), and :attr:`rounds` / :meth:`messages_of` expand them.
    A sender sends each such message once per member.
    """

    model: str
    num_sources: int
    num_destinations: int
    bucket_bytes: int
    source_tensors: TensorTable  # per source rank: local name -> (shape, dtype) it sends from
    destination_tensors: TensorTable  # per destination rank: name -> (shape, dtype)
    class_rounds: tuple[tuple[Message, ...], ...]
    stats: PlanStats
    replica_groups: tuple[tuple[int, ...], ...] = ()  # refit-group ranks, first = stored one
    relay_chains: tuple[tuple[int, ...], ...] = ()  # (entry, next, ...): forwarding order

    @property
    def num_rounds(self) -> int:
        return self._expansion.num_rounds

    @cached_property
    def _expansion(self) -> Expansion:
        return Expansion(self.class_rounds, self.replica_groups, self.relay_chains)

    @cached_property
    def rounds(self) -> tuple[tuple[Message, ...], ...]:
        """Every message of every rank, replica groups and relay runs expanded (for
        small plans; workers use :meth:`messages_of`)."""
        return tuple(tuple(msgs) for msgs in self._expansion.all_messages())

    def traffic(self) -> list[list[tuple[int, int, int]]]:
        """Per round, ``(src, dst, bytes)`` of every message, expanded like :attr:`rounds`."""
        return self._expansion.traffic()

    def expected_tensors(self, group_rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """The live tensors (name -> shape, dtype) this refit-group rank must hold."""
        if group_rank < self.num_sources:
            return self.source_tensors[group_rank]
        return self.destination_tensors[group_rank - self.num_sources]

    def messages_of(self, group_rank: int) -> list[Message]:
        """Every message this refit-group rank sends or receives, in round order."""
        return self._expansion.messages_of(group_rank)

    # -- serialization (JSON, no pickle) ----------------------------------------------
    def _body(self) -> dict[str, Any]:
        def tensors(table: TensorTable) -> list[dict[str, Any]]:
            return [
                {name: [list(shape), dtype] for name, (shape, dtype) in sorted(rank.items())}
                for rank in table
            ]

        names = NameTable()
        rounds = [[message_json(m, names) for m in msgs] for msgs in self.class_rounds]
        return {
            "version": PLAN_VERSION,
            "model": self.model,
            "num_sources": self.num_sources,
            "num_destinations": self.num_destinations,
            "bucket_bytes": self.bucket_bytes,
            "source_tensors": tensors(self.source_tensors),
            "destination_tensors": tensors(self.destination_tensors),
            "replica_groups": [list(g) for g in self.replica_groups],
            "relay_chains": [list(c) for c in self.relay_chains],
            "names": names.names,
            "rounds": rounds,
            "stats": self.stats.to_json(),
        }

    @cached_property
    def _body_text(self) -> str:
        return compact_json(self._body())

    @cached_property
    def fingerprint(self) -> str:
        """16 hex digits of the SHA-256 of the plan's JSON body: computed on first use
        (serialising a DeepSeek-V3 plan takes seconds; building it need not wait)."""
        return fingerprint_of(self._body_text)

    def to_json(self) -> str:
        return self._body_text[:-1] + f',"fingerprint":"{self.fingerprint}"}}'

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

        boxes: dict[tuple, Box] = {}
        rounds = tuple(
            tuple(message_from_json(r, m, data["names"], boxes) for m in msgs)
            for r, msgs in enumerate(data["rounds"])
        )
        s = data["stats"]
        plan = cls(
            model=data["model"],
            num_sources=data["num_sources"],
            num_destinations=data["num_destinations"],
            bucket_bytes=data["bucket_bytes"],
            source_tensors=tensors(data["source_tensors"]),
            destination_tensors=tensors(data["destination_tensors"]),
            class_rounds=rounds,
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
            replica_groups=tuple(tuple(g) for g in data["replica_groups"]),
            relay_chains=tuple(tuple(c) for c in data["relay_chains"]),
        )
        if plan.fingerprint != data["fingerprint"]:
            raise PlanError(
                "plan file content does not match its fingerprint (corrupted or edited)"
            )
        return plan


def replica_groups(destinations: list[RankLayout], offset: int) -> list[tuple[int, ...]]:
    """Destinations (as refit-group ranks) grouped by identical layout, first = smallest.

    A layout's ``replicas`` are the ranks its provider says hold identical pieces;
    a rank joins its first replica's group only if its tensors really are equal
    (cheap when the provider shares them, as replicas usually do).
    """
    groups: dict[int, list[int]] = {}
    for layout in destinations:
        first = min(layout.replicas)
        rep = destinations[first]
        same = layout.tensors is rep.tensors or layout.tensors == rep.tensors
        if first != layout.rank and same:
            groups[first].append(offset + layout.rank)
        else:
            groups[layout.rank] = [offset + layout.rank]
    return [tuple(g) for g in groups.values()]


def _baseline_bytes(
    spec: ModelSpec,
    sources: list[RankLayout],
    destinations: list[RankLayout],
    groups: list[tuple[int, ...]],
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
    readers: dict[str, int] = defaultdict(int)
    itemsize: dict[str, int] = {}
    s = len(sources)
    for g in groups:
        layout = destinations[g[0] - s]
        for name in {p.canonical for p in layout.pieces()}:
            readers[name] += len(g)
        for t in layout.tensors:
            for p in t.pieces:
                itemsize[p.canonical] = DTYPE_BYTES[t.dtype]
    total = 0
    for name, count in readers.items():
        t = spec.tensor(name)
        root_share = max(held.get(name, {0: 0}).values())
        gather = (t.numel - root_share) * itemsize[name]
        total += gather + t.numel * itemsize[name] * count
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
        raise PlanError.listing(
            f"source spec {source.name!r} and destination spec {destination.name!r} disagree "
            f"on {len(problems)} tensor(s)",
            problems,
        )


def plan_refit(
    spec: ModelSpec,
    sources: list[RankLayout],
    destinations: list[RankLayout],
    bucket_mb: float = 512,
    destination_spec: ModelSpec | None = None,
    relay: str = "none",
    links: LinkModel | None = None,
    carry: bool = True,
) -> RefitPlan:
    """Build the transfer plan from every source layout to every destination layout.

    ``relay="chain"`` forwards a box that one training rank would send to several
    inference replicas along a chain of those replicas (``plan/relay.py``);
    ``relay="domain"`` sends one copy per NVLink domain and forwards it inside
    (``plan/domain.py``). ``links`` (a topology, ``plan/topology.py``) makes replica
    choice minimise predicted link busy time instead of bytes per sender and schedules
    rounds by time (``plan/timed.py``); with it and ``carry``, training ranks busier
    than their NVLink domain's mean hand part of their sending to neighbours, which
    carry it through a relay buffer (``plan/carry.py``; direct and domain plans).
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
    return _plan(spec, sources, destinations, bucket_bytes, relay, links, carry)


@paused_gc
def _plan(
    spec: ModelSpec,
    sources: list[RankLayout],
    destinations: list[RankLayout],
    bucket_bytes: int,
    relay: str,
    links: LinkModel | None,
    carry: bool,
) -> RefitPlan:
    regions = source_regions(spec, sources)
    s = len(sources)
    dtype_of = {(s + lay.rank, t.name): t.dtype for lay in destinations for t in lay.tensors}
    # Relay chains forward between replicas, so they plan every destination on its own;
    # a direct plan sends every replica the same messages and plans each group once.
    # ``relay="domain"`` sends one copy into each NVLink domain a group spans (the
    # group's *entries*), and each entry forwards along a chain inside its domain.
    chains: list[tuple[int, ...]] = []
    if relay == "chain":
        groups = [(s + lay.rank,) for lay in destinations]
    else:
        groups = replica_groups(destinations, s)
    needs_of = {g[0]: destination_needs(destinations[g[0] - s], regions, g[0]) for g in groups}
    lone: list[int] = []
    if relay == "domain":

        def need_for(rep: int) -> list[Need]:
            return destination_needs(destinations[rep - s], regions, rep)

        groups, runs_of, lone = domain_groups(groups, needs_of, need_for, dtype_of, links, carry)
        chains = [run for runs in runs_of.values() for run in runs if len(run) > 1]
        members = {rep: tuple(run[0] for run in runs) for rep, runs in runs_of.items()}
    else:
        members = {g[0]: g for g in groups}
    needs = [n for g in groups for n in needs_of[g[0]]]
    transfers = coalesce(assign_senders(needs, dtype_of, links, members))
    if relay == "chain":
        direct, *forwarded = chain_replicas(transfers, links)
        rounds = schedule(direct, bucket_bytes, forwarded, links)
    else:
        if relay == "domain":
            transfers, members = domain_entries(transfers, runs_of)
        if links is not None:
            # Training ranks above their NVLink domain's mean hand part of their sending
            # to neighbours below it (carried through relay buffers, ``plan/carry.py``).
            carried: list[tuple[Transfer, int]] = []
            if carry:
                transfers, carried = choose_carriers(transfers, links, members, s)
            if lone:
                transfers, more = choose_ingress_carriers(
                    transfers, links, members, chains, lone, carried
                )
                carried += more
            rounds = timed_schedule(transfers, bucket_bytes, links, members, chains, carried).rounds
        else:
            rounds = schedule(transfers, bucket_bytes, members=members)

    receivers = [g for g in members.values() if len(g) > 1]
    expansion = Expansion(rounds, receivers, chains)
    sent = [0] * (s + len(destinations))
    received = [0] * (s + len(destinations))
    used_src: list[set[str]] = [set() for _ in sources]
    pairs: set[tuple[int, int, int]] = set()  # one message per (round, sender, receiver)
    num_transfers = 0
    for messages in rounds:
        for m in messages:
            if m.src < s:
                used_src[m.src].update(t.src_tensor for t in m.transfers)
            for key in expansion.deliveries(m):
                whole = not key[3] and key[2] == m.dst  # else only its shared part
                content = m if whole or m.shared is None else m.shared
                sent[key[1]] += content.nbytes
                received[key[2]] += content.nbytes
                num_transfers += len(content.transfers)
                pairs.add(key[:3])
    min_bytes = sum(
        len(g) * p.canonical_box.numel * DTYPE_BYTES[t.dtype]
        for g in groups
        for t in destinations[g[0] - s].tensors
        for p in t.pieces
    )
    stats = PlanStats(
        bytes_sent=tuple(sent),
        bytes_received=tuple(received),
        total_bytes=sum(sent),
        min_bytes=min_bytes,
        baseline_bytes=_baseline_bytes(spec, sources, destinations, groups, dtype_of),
        num_transfers=num_transfers,
        num_messages=len(pairs),
        num_rounds=expansion.num_rounds,
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
        class_rounds=tuple(tuple(msgs) for msgs in rounds),
        stats=stats,
        replica_groups=tuple(sorted(receivers)),
        relay_chains=tuple(chains),
    )
    return plan
