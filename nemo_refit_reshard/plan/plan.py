"""``plan_refit``: layouts of both sides in, a :class:`~.refit_plan.RefitPlan` out.

Every non-padding element of every destination tensor is delivered exactly once, from
a training rank that holds it. The plan is built by six passes, each one module with
one entry function and a typed result you can print::

    needs    = find_needs(spec, sources, destinations)       # 1 plan/needs.py
    fanout   = plan_fanout(needs, relay, links, carry)       # 2 plan/fanout.py
    senders  = choose_senders(needs, fanout, links)          # 3 plan/senders.py
    routes   = plan_routes(senders, fanout, links, carry, S) # 4 plan/routes.py
    rounds   = plan_rounds(routes, bucket_bytes, links)      # 5 plan/rounds.py
    messages = to_messages(rounds.transfers)                 # 6 plan/messages.py

``relay="auto"`` with a topology runs passes 2-4 for each candidate relay mode and
pass 5 only for those whose routes could still win (``plan/choice.py``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from operator import attrgetter, itemgetter

from ..layouts.base import RankLayout, paused_gc
from ..spec.model import ModelSpec
from .choice import RelayChoice, choose_relay
from .expand import Expansion
from .fanout import RELAY_MODES, plan_fanout
from .messages import Message, to_messages
from .needs import Needs, find_needs
from .overlap import PlanError
from .refit_plan import PlanStats, RefitPlan
from .rounds import plan_rounds
from .routes import Routes, plan_routes
from .senders import choose_senders
from .transfer import DTYPE_BYTES, LinkModel

RELAY_CHOICES = ("auto", *RELAY_MODES)
_SRC_TENSOR = itemgetter(2)  # a transfer's source tensor
_CANONICAL, _NUMEL = attrgetter("canonical"), attrgetter("canonical_box.numel")  # a piece's


def plan_refit(
    spec: ModelSpec,
    sources: list[RankLayout],
    destinations: list[RankLayout],
    bucket_mb: float = 512,
    destination_spec: ModelSpec | None = None,
    relay: str = "auto",
    links: LinkModel | None = None,
    carry: bool = True,
) -> RefitPlan:
    """Build the transfer plan from every source layout to every destination layout.

    ``relay="chain"`` forwards a box that one training rank would send to several
    inference replicas along a chain of those replicas (``plan/relay.py``);
    ``relay="domain"`` sends one copy per NVLink domain and forwards it inside
    (``plan/domain.py``); ``relay="none"`` sends every replica its own copy.
    ``relay="auto"`` (the default) is ``"none"`` without a topology; with one it picks
    the mode with the lowest predicted time (``plan/choice.py``; the plan's
    ``relay_choice`` says which and why). ``links`` (a topology, ``plan/topology.py``)
    makes replica choice minimise predicted link busy time instead of bytes per sender
    and schedules rounds by time (``plan/timed.py``); with it and ``carry``, training
    ranks busier than their NVLink domain's mean hand part of their sending to
    neighbours, which carry it through a relay buffer (``plan/carry.py``).
    """
    if relay not in RELAY_CHOICES:
        raise PlanError(f"unknown relay mode {relay!r}; choose one of {RELAY_CHOICES}")
    if destination_spec is not None:
        check_specs_match(spec, destination_spec)
    if [lay.rank for lay in sources] != list(range(len(sources))):
        raise PlanError("source layouts must be given for ranks 0..S-1 in order")
    if [lay.rank for lay in destinations] != list(range(len(destinations))):
        raise PlanError("destination layouts must be given for ranks 0..D-1 in order")
    bucket_bytes = int(bucket_mb * 2**20)
    if bucket_bytes <= 0:
        raise ValueError("bucket size must be positive")
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
    needs = find_needs(spec, sources, destinations)

    def route(mode: str) -> Routes:
        """Passes 2-4 for one relay mode."""
        fanout = plan_fanout(needs, mode, links, carry)
        senders = choose_senders(needs, fanout, links)
        return plan_routes(senders, fanout, links, carry, needs.num_sources)

    choice = None
    if relay == "auto" and links is not None:
        choice, routes, rounds = choose_relay(needs, route, bucket_bytes, links)
    else:
        routes = route("none" if relay == "auto" else relay)
        rounds = plan_rounds(routes, bucket_bytes, links)
    messages = to_messages(rounds.transfers)
    return _assemble(spec, sources, destinations, bucket_bytes, needs, routes, messages, choice)


def _assemble(
    spec: ModelSpec,
    sources: list[RankLayout],
    destinations: list[RankLayout],
    bucket_bytes: int,
    needs: Needs,
    routes: Routes,
    messages: list[list[Message]],
    choice: RelayChoice | None,
) -> RefitPlan:
    """The plan object and its stats (bytes per rank counted over every delivery)."""
    s = len(sources)
    chains = routes.chains
    groups = needs.groups
    receivers = [g for g in routes.members.values() if len(g) > 1]
    expansion = Expansion(messages, receivers, chains)
    sent = [0] * (s + len(destinations))
    received = [0] * (s + len(destinations))
    used_src: list[set[str]] = [set() for _ in sources]
    pairs: set[tuple[int, int, int]] = set()  # one message per (round, sender, receiver)
    num_transfers = 0
    for msgs in messages:
        for m in msgs:
            if m.src < s:
                used_src[m.src].update(map(_SRC_TENSOR, m.transfers))
            for key in expansion.deliveries(m):
                whole = not key[3] and key[2] == m.dst  # else only its shared part
                content = m if whole or m.shared is None else m.shared
                sent[key[1]] += content.nbytes
                received[key[2]] += content.nbytes
                num_transfers += len(content.transfers)
                pairs.add(key[:3])
    min_bytes = sum(
        len(g) * sum(map(_NUMEL, t.pieces)) * DTYPE_BYTES[t.dtype]
        for g in groups
        for t in destinations[g[0] - s].tensors
    )
    stats = PlanStats(
        bytes_sent=tuple(sent),
        bytes_received=tuple(received),
        total_bytes=sum(sent),
        min_bytes=min_bytes,
        baseline_bytes=_baseline_bytes(spec, sources, destinations, groups),
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
        class_rounds=tuple(tuple(msgs) for msgs in messages),
        stats=stats,
        replica_groups=tuple(sorted(receivers)),
        relay_chains=tuple(chains),
        relay_choice=choice,
    )
    return plan


def _baseline_bytes(
    spec: ModelSpec,
    sources: list[RankLayout],
    destinations: list[RankLayout],
    groups: tuple[tuple[int, ...], ...],
) -> int:
    """Bytes of the gather-broadcast baseline (``plan/baseline.py``): each needed tensor
    gathered to the source rank holding most of it, then sent whole to every destination
    that needs any of it, all in the destination dtype."""
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
            sized = dict.fromkeys(map(_CANONICAL, t.pieces), DTYPE_BYTES[t.dtype])
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
