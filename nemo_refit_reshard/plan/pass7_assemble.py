"""Pass 7, assembly: the plan object and its stats from the passes' results.

Bytes per rank are counted over every delivery (replica members, relay runs, carried
legs, ``result/expand.py``); ``min_bytes`` is what the destinations store (the floor any
refit must move); ``baseline_bytes`` what the gather-broadcast baseline would move.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter

from ..layouts.base import RankLayout
from ..spec.model import ModelSpec
from ..spec.quantization import FP8, SCALE_SUFFIX
from .base import DTYPE_BYTES, is_relay
from .config import PlanConfig
from .pass1_needs import Needs
from .pass4_routes import Routes
from .pass6_messages import Message, Messages
from .relay_choice import RelayChoice
from .result.expand import Expansion
from .result.fp8_steps import destination_steps, source_steps
from .result.refit_plan import PlanStats, RefitPlan

_SRC_TENSOR = itemgetter(2)  # a transfer's source tensor
_CANONICAL, _NUMEL = attrgetter("canonical"), attrgetter("canonical_box.numel")  # a piece's


def assemble_plan(
    spec: ModelSpec,
    sources: list[RankLayout],
    destinations: list[RankLayout],
    config: PlanConfig,
    needs: Needs,
    routes: Routes,
    messages: Messages,
    choice: RelayChoice | None,
) -> RefitPlan:
    """Pass 7 (module docstring)."""
    bucket_bytes = config.bucket_bytes
    s = len(sources)
    chains = routes.chains
    groups = needs.groups
    receivers = [g for g in routes.members.values() if len(g) > 1]
    expansion = Expansion(messages.rounds, receivers, chains)
    used_src: list[set[str]] = [set() for _ in sources]
    fp8_block = spec.arch.quant.block if spec.arch.quant is not None else None
    for msgs in messages.rounds:
        for m in msgs:
            if m.src < s:
                used_src[m.src].update(map(_SRC_TENSOR, m.transfers))
    counts = count_deliveries(messages.rounds, expansion, s + len(destinations), fp8_block)
    min_bytes = sum(
        len(g) * sum(map(_NUMEL, t.pieces)) * DTYPE_BYTES[t.dtype]
        for g in groups
        for t in destinations[g[0] - s].tensors
    )
    stats = counts.stats(
        min_bytes, baseline_bytes(spec, sources, destinations, groups), expansion.num_rounds
    )
    plan = RefitPlan(
        model=spec.name,
        num_sources=len(sources),
        num_destinations=len(destinations),
        bucket_bytes=bucket_bytes,
        source_tensors=tuple(live_sources(lay, used_src[lay.rank]) for lay in sources),
        destination_tensors=tuple(live_destinations(lay) for lay in destinations),
        class_rounds=tuple(tuple(msgs) for msgs in messages.rounds),
        stats=stats,
        replica_groups=tuple(sorted(receivers)),
        relay_chains=tuple(chains),
        colocated_hosts=config.colocation.hosts if config.colocation is not None else (),
        relay_choice=choice,
        fp8_block=fp8_block,
        quantize_steps=()
        if fp8_block is None
        else tuple(source_steps(lay, used_src[lay.rank]) for lay in sources)
        + tuple(destination_steps(lay) for lay in destinations),
    )
    return plan


@dataclass
class DeliveryCounts:
    """Bytes and messages over every delivery of a plan's stored messages."""

    sent: list[int]  # per refit-group rank
    received: list[int]
    num_transfers: int = 0
    pairs: set[tuple[int, int, int]] = field(default_factory=set)  # (round, src, dst)
    by_dtype: Counter[str] = field(default_factory=Counter)  # block-FP8 plans only
    carried_in: list[int] = field(default_factory=list)  # per rank: into relay buffers

    def stats(self, min_bytes: int, baseline: int, num_rounds: int) -> PlanStats:
        return PlanStats(
            bytes_sent=tuple(self.sent),
            bytes_received=tuple(self.received),
            total_bytes=sum(self.sent),
            min_bytes=min_bytes,
            baseline_bytes=baseline,
            num_transfers=self.num_transfers,
            num_messages=len(self.pairs),
            num_rounds=num_rounds,
            bytes_by_dtype=tuple(sorted(self.by_dtype.items())),
        )


def count_deliveries(
    rounds: Sequence[Sequence[Message]],
    expansion: Expansion,
    world: int,
    fp8_block: tuple[int, int] | None,
) -> DeliveryCounts:
    """Every delivery of every stored message (``result/expand.py``), counted: what
    each rank sends and receives (a relay buffer's bytes apart), transfers, messages
    (one per round, sender and receiver) and, in block-FP8 plans, bytes by dtype."""
    out = DeliveryCounts([0] * world, [0] * world, carried_in=[0] * world)
    for msgs in rounds:
        for m in msgs:
            for key in expansion.deliveries(m):
                whole = not key[3] and key[2] == m.dst  # else only its shared part
                content = m if whole or m.shared is None else m.shared
                out.sent[key[1]] += content.nbytes
                out.received[key[2]] += content.nbytes
                if content.shared is not content:  # part of it fills a relay buffer
                    relayed = (t.nbytes for t in content.transfers if is_relay(t.dst_tensor))
                    out.carried_in[key[2]] += sum(relayed)
                out.num_transfers += len(content.transfers)
                out.pairs.add(key[:3])
                if fp8_block is not None:
                    for t in content.transfers:
                        out.by_dtype[t.dtype] += t.nbytes
    return out


def live_sources(layout: RankLayout, used: set[str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """The live tensors a sending rank reads: those it sends from, and those it quantizes
    derived tensors from (``layouts/fp8_wire.py``)."""
    live = {}
    steps = source_steps(layout, used)
    derived = {q.weight for q in steps} | {q.scale for q in steps}
    for t in layout.tensors:
        if t.name in used and t.name not in derived:
            live[t.name] = (t.shape, t.dtype)
    for step in steps:
        origin = layout.tensor(step.source or "")
        live[origin.name] = (origin.shape, origin.dtype)
    return live


def live_destinations(layout: RankLayout) -> dict[str, tuple[tuple[int, ...], str]]:
    """The live tensors a receiving rank writes: a shadow's live tensor is e4m3, with its
    scale (``layouts/fp8_wire.py``)."""
    live = {}
    for t in layout.tensors:
        if not t.pieces:
            continue
        if t.fp8 is None:
            live[t.name] = (t.shape, t.dtype)
            continue
        scale = layout.tensor(t.fp8.scale)
        live[t.name] = (t.shape, FP8)
        live[scale.name] = (scale.shape, scale.dtype)
    return live


def baseline_bytes(
    spec: ModelSpec,
    sources: list[RankLayout],
    destinations: list[RankLayout],
    groups: tuple[tuple[int, ...], ...],
) -> int:
    """Bytes of the gather-broadcast baseline (``analysis/baseline.py``): each needed tensor
    gathered to the source rank holding most of it, then sent whole to every destination
    that needs any of it, all in the destination dtype — into a block-FP8 engine NeMo
    RL's way: every weight in the trained dtype, no scales (quantized on arrival)."""
    trained = DTYPE_BYTES[spec.unquantized().arch.dtype] if spec.arch.quant else 0
    held: dict[str, dict[int, int]] = {}
    for layout in sources:
        for p in layout.pieces():
            per = held.setdefault(p.canonical, {})
            per[layout.rank] = per.get(layout.rank, 0) + p.canonical_box.numel
    itemsize: dict[str, int] = {}
    s = len(sources)
    # per group size, how many groups read each tensor (counted in C: a layout has a
    # piece per expert slice)
    groups_reading: dict[int, Counter[str]] = defaultdict(Counter)
    for g in groups:
        layout = destinations[g[0] - s]
        names: set[str] = set()
        for t in layout.tensors:
            if trained and t.dtype == "float32" and t.name.endswith(SCALE_SUFFIX):
                continue  # scales: the baseline sends none
            size = trained if trained and t.dtype == FP8 else DTYPE_BYTES[t.dtype]
            sized = dict.fromkeys(map(_CANONICAL, t.pieces), size)
            names.update(sized)
            itemsize.update(sized)
        groups_reading[len(g)].update(names)
    readers: dict[str, int] = defaultdict(int)
    for size, counts in groups_reading.items():
        for name, count in counts.items():
            readers[name] += size * count
    total = 0
    for name, count in readers.items():
        t = spec.tensor(name)
        root_share = max(held.get(name, {0: 0}).values())
        gather = (t.numel - root_share) * itemsize[name]
        total += gather + t.numel * itemsize[name] * count
    return total
