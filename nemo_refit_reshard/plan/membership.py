"""A plan per set of engines: the full plan with some inference engines left out.

The inference side of a refit group can change between steps (an engine fenced after
a failure, one admitted). The plan for the engines that remain is *derived* from the
full plan instead of planned again (``plan_refit`` takes 17-35 s for DeepSeek-V3
256→256; deriving takes a fraction of that), so it can be ready before the next step:

* every stored message goes to the first member of its replica group
  (``result/expand.py``); a group that loses members keeps the others, and a group that
  loses its stored member is stored under the next one (``Message.to``: replicas hold
  the same local boxes). A group that loses every member loses its messages: its
  senders send less, nobody else changes;
* a relay run (``relay="domain"``) that loses a member closes around it: the messages
  that entered the run at the lost member enter at the members that remain — spread,
  by bytes, over the groups that enter the same runs (or the group's own members and
  heirs) — and go round the shorter run from there, one hop per round as before, so
  every hop still leaves its sender a round after it arrived;
* destinations are renumbered ``S + 0 ..`` in their old order (relay buffer names
  too); the training ranks keep theirs. Stats are counted again over the derived
  deliveries.

Exact by construction: every remaining destination receives what it received in the
full plan, from the same training rank, in the same round or earlier (checked against
the layouts for every subset of engines in ``tests/test_membership_plans.py``). What
derivation cannot express raises :class:`DerivationError`, and
:class:`MembershipPlans` plans that set again with its ``replan`` (:attr:`MemberPlan.how`
says so): a ``relay="chain"`` plan where a leaving engine forwards to others, carried
legs (``carry``) to or through a leaving engine.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from operator import itemgetter, methodcaller
from typing import Any

from ..layouts.base import RankLayout, paused_gc
from ..spec.model import ModelSpec
from .base import (
    RELAY,
    PlanError,
    Transfer,
    in_message_order,
    is_relay,
    new_transfer,
    relay_tensor,
    relayed_to,
)
from .cluster import Placement, Topology
from .colocation import Colocation
from .pass6_messages import Message
from .pass7_assemble import baseline_bytes
from .result.expand import Expansion
from .result.refit_plan import PlanStats, RefitPlan

_SRC_TENSOR = itemgetter(2)
_STARTS_RELAY = methodcaller("startswith", RELAY)


@dataclass(frozen=True)
class MemberPlan:
    """The plan for a set of engines, and how it was made.

    ``engines``: the engines it serves, in refit-rank order; ``destinations[i]`` is the
    full plan's destination index of this plan's destination ``i`` (refit rank
    ``num_sources + i``)."""

    plan: RefitPlan
    engines: tuple[int, ...]
    destinations: tuple[int, ...]
    how: str  # "full", "derived", "re-planned: <why>" or "planned again"
    seconds: float

    def refit_rank(self, full_destination: int) -> int:
        """This plan's refit rank of the full plan's destination ``full_destination``."""
        return self.plan.num_sources + self.destinations.index(full_destination)

    def __str__(self) -> str:
        return (
            f"MemberPlan(engines {list(self.engines)}, {len(self.destinations)} destination "
            f"rank(s), plan {self.plan.fingerprint}, {self.how}, {self.seconds:.2f} s)"
        )


class DerivationError(PlanError):
    """The full plan cannot be narrowed to these engines without planning again."""


@paused_gc
def derive_plan(
    plan: RefitPlan,
    keep: Sequence[int],
    spec: ModelSpec,
    sources: list[RankLayout],
    destinations: list[RankLayout],
) -> RefitPlan:
    """``plan`` narrowed to the destinations ``keep`` (full-plan destination indices, in
    increasing order); ``spec`` and the layouts are the ones ``plan`` was built from
    (they give the baseline's bytes). Raises :class:`DerivationError` for what the
    module docstring lists."""
    s = plan.num_sources
    if list(keep) != sorted(set(keep)) or not keep or keep[-1] >= plan.num_destinations:
        raise PlanError(
            f"destinations to keep must be distinct, increasing indices below "
            f"{plan.num_destinations}; got {list(keep)}"
        )
    gone = {s + d for d in range(plan.num_destinations)} - {s + d for d in keep}
    new_rank = {s + d: s + i for i, d in enumerate(keep)}
    new_rank.update((r, r) for r in range(s))

    heirs: dict[int, list[int]] = {}  # a run member that leaves -> those left, from the next
    runs = []
    for run in plan.relay_chains:
        left = [m for m in run if m not in gone]
        for i, m in enumerate(run):
            if m in gone and left:
                heirs[m] = [x for x in run[i + 1 :] + run[:i] if x not in gone]
        if len(left) > 1:
            runs.append(tuple(left))
    group_of = {g[0]: g for g in plan.replica_groups}

    def vanishes(d: int) -> bool:
        """Whether what ``d`` stood for is delivered to nobody any more."""
        return all(x in gone and x not in heirs for x in group_of.get(d, (d,)))

    stored: dict[int, list[Message]] = defaultdict(list)  # stored receiver -> its messages
    for msgs in plan.class_rounds:
        for m in msgs:
            finals = _relay_finals(m)
            if finals:
                m = _carried_legs(m, finals, gone, vanishes)
                if m is None:
                    continue
            if m.src in gone:
                raise DerivationError(
                    f"destination rank {m.src} forwards to other engines (relay='chain')"
                )
            stored[m.dst].append(m)
    stored_as = {k: "group" for k in group_of if k not in gone}  # receivers that remain
    stored_as.update((k, "alone") for k in stored if k not in group_of and k not in gone)
    run_id = {m: i for i, run in enumerate(runs) for m in run}
    by_pair: dict[tuple[int, int, int], list[Message]] = defaultdict(list)
    groups: list[tuple[int, ...]] = []
    load: Counter[int] = Counter()  # bytes entering at each member (relay runs)

    def store(m: Message, home: tuple[int, ...]) -> None:
        if home[0] != m.dst:
            if m.shared is not m:
                raise DerivationError(f"destination rank {m.dst} receives into a relay buffer")
            m = m.to(home[0])
        by_pair[(m.round, m.src, m.dst)].append(m)
        for x in home:
            load[x] += m.nbytes

    # Groups that lose no relay entry keep their messages; those that do find them new
    # entries (below), among groups that enter the same runs.
    homeless = []
    homes: dict[frozenset, list[tuple[int, ...]]] = defaultdict(list)
    for key in sorted(stored):
        group = group_of.get(key, (key,))
        if any(y in heirs for y in group):
            homeless.append(key)
            continue
        for home in _parts(group, key, gone, heirs, stored_as):
            for m in stored[key]:
                store(m, home)
            groups.append(home)
            runs_entered = [run_id.get(x, -1 - x) for x in home]
            if len(set(runs_entered)) == len(home):
                homes[frozenset(runs_entered)].append(home)
    for key in homeless:
        group = group_of.get(key, (key,))
        entered = frozenset(
            run_id.get(heirs[x][0], -1 - heirs[x][0]) if x in gone else run_id.get(x, -1 - x)
            for x in group
            if x not in gone or x in heirs
        )
        candidates = homes.get(entered)
        if not candidates:  # the group's own members and heirs take its entries
            candidates = _parts(group, key, gone, heirs, stored_as)
            groups.extend(candidates)
            for part in candidates:  # ... and can take later groups' entries too
                runs_entered = [run_id.get(x, -1 - x) for x in part]
                if len(set(runs_entered)) == len(part):
                    homes[frozenset(runs_entered)].append(part)
        for m in stored[key]:
            # where the busiest entry member has brought in least (ties: first home)
            store(m, min(candidates, key=lambda h: max(load[x] for x in h)))
    groups = [g for g in groups if len(g) > 1]
    rounds: list[list[Message]] = [[] for _ in plan.class_rounds]
    for (r, _, _), msgs in sorted(by_pair.items()):
        m = msgs[0] if len(msgs) == 1 else _merged(msgs)
        rounds[r].append(_renumbered(m, new_rank))
    if not runs:  # no hop lags behind its round: rounds left empty can go
        rounds = [msgs for msgs in rounds if msgs]
        rounds = [[_in_round(m, r) for m in msgs] for r, msgs in enumerate(rounds)]
    new_groups = tuple(sorted(tuple(new_rank[m] for m in g) for g in groups))
    new_runs = tuple(tuple(new_rank[m] for m in run) for run in runs)
    kept_layouts = narrowed_layouts(destinations, keep)
    quant = plan.quantize_steps
    return RefitPlan(
        model=plan.model,
        num_sources=s,
        num_destinations=len(keep),
        bucket_bytes=plan.bucket_bytes,
        source_tensors=plan.source_tensors,
        destination_tensors=tuple(plan.destination_tensors[d] for d in keep),
        class_rounds=tuple(tuple(msgs) for msgs in rounds),
        stats=_stats(rounds, new_groups, new_runs, spec, sources, kept_layouts, plan),
        replica_groups=new_groups,
        relay_chains=new_runs,
        colocated_hosts=tuple(plan.colocated_hosts[d] for d in keep)
        if plan.colocated_hosts
        else (),
        fp8_block=plan.fp8_block,
        quantize_steps=quant[:s] + tuple(quant[s + d] for d in keep) if quant else (),
    )


def narrowed_layouts(destinations: list[RankLayout], keep: Sequence[int]) -> list[RankLayout]:
    """The layouts of the destinations ``keep``, renumbered ``0..`` as a plan for them
    numbers them (their replica sets narrowed alike)."""
    index = {d: i for i, d in enumerate(keep)}
    return [
        replace(
            destinations[d],
            rank=i,
            world_size=len(keep),
            replicas=tuple(index[r] for r in destinations[d].replicas if r in index),
        )
        for i, d in enumerate(keep)
    ]


def _parts(
    group: tuple[int, ...],
    key: int,
    gone: set[int],
    heirs: dict[int, list[int]],
    stored_as: dict[int, str],
) -> list[tuple[int, ...]]:
    """What becomes of one replica group: member sets (stored receiver first) over which
    its messages are split; none if no member remains and none can take over.

    A member that leaves hands its entries to the members left in its relay run, each
    a part of the group's messages (by bytes), so that the NICs of those left share
    what entered at the one that left. A part of several members needs a stored
    receiver no other part is stored under; one of a single member may share it with
    other single-member parts (their messages merge). ``stored_as`` (rank -> "group" or
    "alone") records the receivers taken, and is updated."""
    left = [m for m in group if m not in gone]
    lost = [y for y in group if y in gone and y in heirs]
    if not lost and not left:
        return []
    takings = [[heirs[y][i % len(heirs[y])] for y in lost] for i in range(
        max((len(heirs[y]) for y in lost), default=1))]  # fmt: skip
    parts: list[tuple[int, ...]] = []
    for taking in takings:
        members = list(dict.fromkeys((*left, *taking)))
        kind = "group" if len(members) > 1 else "alone"
        for first in members:
            taken = stored_as.get(first)
            if first in (p[0] for p in parts) or (
                first != key and taken is not None and "group" in (taken, kind)
            ):
                continue
            stored_as[first] = kind
            parts.append((first, *(m for m in members if m != first)))
            break
    if not parts:
        raise DerivationError(f"no member of replica group {list(group)} can be stored")
    return parts


def _merged(msgs: list[Message]) -> Message:
    """Stored messages that now share a (round, sender, receiver): one message."""
    m = msgs[0]
    transfers = [t for x in msgs for t in x.transfers]
    return Message(m.round, m.src, m.dst, tuple(in_message_order(transfers)))


def _in_round(m: Message, r: int) -> Message:
    return m if m.round == r else Message(r, m.src, m.dst, m.transfers)


def _carried_legs(
    m: Message, finals: set[int], gone: set[int], vanishes: Callable[[int], bool]
) -> Message | None:
    """A message with carried legs (``pass4_routes/carry.py``), as the engines left need
    it: the legs carried to a destination whose deliveries vanish are dropped (None: all
    of them); a leaving carrier, or a carried destination that leaves but whose group
    remains, cannot be derived."""
    carrier_leaves = m.src in gone or (m.dst in gone and m.shared is not m)
    unfed = {d for d in finals & gone if not vanishes(d)}
    if carrier_leaves or unfed:
        raise DerivationError(
            "a leaving engine carries, or is carried to, through relay buffers "
            "(carry: the plan's carried legs name it)"
        )
    dead = finals & gone
    if not dead:
        return m
    keep = tuple(
        t
        for t in m.transfers
        if (relayed_to(t[4]) or (None,))[0] not in dead
        and (relayed_to(t[2]) or (None,))[0] not in dead
    )
    return Message(m.round, m.src, m.dst, keep) if keep else None


def _relay_finals(m: Message) -> set[int]:
    """The final destinations named by the relay buffers ``m`` fills or empties
    (carried legs, ``pass4_routes/carry.py``)."""
    ts = m.transfers
    # (in C: plans hold millions of transfers, a handful of them carried)
    if m.shared is m and not any(map(_STARTS_RELAY, map(_SRC_TENSOR, ts))):
        return set()
    names = {t[2] for t in ts if is_relay(t[2])} | {t[4] for t in ts if is_relay(t[4])}
    return {relayed_to(name)[0] for name in names}  # type: ignore[index]


def _renamed(name: str, new_rank: dict[int, int]) -> str:
    """A relay buffer's name with its final destination renumbered."""
    final = relayed_to(name)
    return name if final is None else relay_tensor(new_rank[final[0]], final[1])


def _renumbered(m: Message, new_rank: dict[int, int]) -> Message:
    src, dst = new_rank[m.src], new_rank[m.dst]
    if _relay_finals(m):  # relay buffer names carry a rank too
        return Message(
            m.round,
            src,
            dst,
            tuple(
                new_transfer(
                    Transfer,
                    (src, dst, _renamed(t[2], new_rank), t[3], _renamed(t[4], new_rank), *t[5:]),
                )
                for t in m.transfers
            ),
        )
    if (src, dst) == (m.src, m.dst):
        return m
    return Message(
        m.round, src, dst, tuple(new_transfer(Transfer, (src, dst, *t[2:])) for t in m.transfers)
    )


def _stats(
    rounds: list[list[Message]],
    groups: tuple[tuple[int, ...], ...],
    runs: tuple[tuple[int, ...], ...],
    spec: ModelSpec,
    sources: list[RankLayout],
    destinations: list[RankLayout],
    full: RefitPlan,
) -> PlanStats:
    """Pass 7's counts over the derived deliveries (``pass7_assemble.py``)."""
    s = full.num_sources
    expansion = Expansion(rounds, groups, runs)
    sent = [0] * (s + len(destinations))
    received = [0] * (s + len(destinations))
    pairs: set[tuple[int, int, int]] = set()
    num_transfers = 0
    carried = 0  # bytes destinations receive into relay buffers (they store none of it)
    by_dtype: Counter[str] = Counter()
    for msgs in rounds:
        for m in msgs:
            for key in expansion.deliveries(m):
                whole = not key[3] and key[2] == m.dst
                content = m if whole or m.shared is None else m.shared
                sent[key[1]] += content.nbytes
                received[key[2]] += content.nbytes
                if key[2] >= s and content.shared is not content:
                    carried += sum(t.nbytes for t in content.transfers if is_relay(t[4]))
                num_transfers += len(content.transfers)
                pairs.add(key[:3])
                if full.fp8_block is not None:
                    for t in content.transfers:
                        by_dtype[t.dtype] += t.nbytes
    # Every destination receives exactly what it stores, and a carrier also what it
    # carries: the floor is what the remaining destinations receive, less that.
    min_bytes = sum(received[s:]) - carried
    # identical layouts counted once per class, as pass 1's groups are
    classes = tuple(sorted({tuple(s + r for r in lay.replicas) for lay in destinations}))
    return PlanStats(
        bytes_sent=tuple(sent),
        bytes_received=tuple(received),
        total_bytes=sum(sent),
        min_bytes=min_bytes,
        baseline_bytes=baseline_bytes(spec, sources, destinations, classes),
        num_transfers=num_transfers,
        num_messages=len(pairs),
        num_rounds=expansion.num_rounds,
        bytes_by_dtype=tuple(sorted(by_dtype.items())),
    )


@dataclass
class MembershipPlans:
    """The full plan, and a plan per set of engines derived from it (cached).

    ``engines[e]``: the full plan's destination indices of engine ``e`` (its ranks).
    ``replan``: plans the remaining layouts again where derivation cannot (the caller's
    ``plan_refit`` settings: bucket size, relay mode, topology); None: such a set of
    engines is refused. :meth:`build` plans the full plan and sets ``replan`` alike."""

    plan: RefitPlan
    spec: ModelSpec
    sources: list[RankLayout]
    destinations: list[RankLayout]
    engines: tuple[tuple[int, ...], ...]
    # (the kept destinations' layouts, renumbered; their indices in the full plan)
    replan: Callable[[list[RankLayout], tuple[int, ...]], RefitPlan] | None = None
    _cache: dict[frozenset[int], MemberPlan] = field(default_factory=dict, repr=False)
    # sets being derived ahead (derive_ahead), and the lock over both tables
    _pending: dict[frozenset[int], tuple[Future, bool]] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def build(
        cls,
        spec: ModelSpec,
        sources: list[RankLayout],
        destinations: list[RankLayout],
        engines: tuple[tuple[int, ...], ...],
        **plan_refit_args: Any,
    ) -> MembershipPlans:
        """The full plan (``plan_refit(spec, sources, destinations, **plan_refit_args)``),
        and the same settings for the sets derivation cannot express."""
        from .build import plan_refit

        def replan(kept: list[RankLayout], keep: tuple[int, ...]) -> RefitPlan:
            args = dict(plan_refit_args)
            links = args.get("links")
            if isinstance(links, Topology):  # the nodes of the ranks kept
                s, nodes = len(sources), links.placement.nodes
                placement = Placement(s, nodes[:s] + tuple(nodes[s + d] for d in keep))
                args["links"] = Topology(links.cluster, placement)
            colocation = args.get("colocation")
            if colocation is not None:
                args["colocation"] = Colocation(tuple(colocation.hosts[d] for d in keep))
            return plan_refit(spec, sources, kept, **args)

        full = plan_refit(spec, sources, destinations, **plan_refit_args)
        return cls(full, spec, sources, destinations, engines, replan)

    def __post_init__(self) -> None:
        flat = sorted(d for ranks in self.engines for d in ranks)
        if flat != list(range(self.plan.num_destinations)):
            raise PlanError(
                f"engines {[list(e) for e in self.engines]} must hold every destination of "
                f"the plan (0..{self.plan.num_destinations - 1}) exactly once"
            )

    def for_engines(self, engines: Iterable[int]) -> MemberPlan:
        """The plan for these engines (any order, at least one), built once per set: a
        set the derive-ahead thread is deriving is waited for, one it has not reached yet
        is derived here."""
        chosen = self._chosen(engines)
        what, value = self._claim(frozenset(chosen))
        if what == "cached":
            return value
        if what == "wait":
            return value.result()
        return self._derive(chosen, value)

    def derive_ahead(self, sets: Iterable[Iterable[int]]) -> Future:
        """Derive the plans for ``sets`` in a thread, off the step's critical path (e.g.
        every set of the engines serving less one, right after a group is made, so that
        a failure usually finds its plan ready). The future is done when all are (its
        result: how many this thread derived)."""
        wanted = [self._chosen(engines) for engines in sets]
        queued = []
        with self._lock:
            for chosen in wanted:
                key = frozenset(chosen)
                if key not in self._cache and key not in self._pending:
                    self._pending[key] = (Future(), False)  # queued, not claimed
                    queued.append(chosen)
        done: Future = Future()

        def run() -> None:
            count = 0
            for chosen in queued:
                what, value = self._claim(frozenset(chosen))
                if what == "derive":
                    # the collector stays on: gc.disable() is process-wide, and this
                    # thread runs beside the driver
                    self._derive(chosen, value, pause_gc=False)
                    count += 1
            done.set_result(count)

        try:
            threading.Thread(target=run, name="derive-ahead", daemon=True).start()
        except BaseException as err:  # no thread: nobody may wait on these sets
            with self._lock:
                for chosen in queued:
                    future, _ = self._pending.pop(frozenset(chosen))
                    future.set_exception(err)
            raise
        return done

    def _claim(self, key: frozenset[int]) -> tuple[str, Any]:
        """``("cached", plan)``, ``("wait", future)`` (another thread derives it) or
        ``("derive", future)`` (the caller derives it and resolves the future)."""
        with self._lock:
            if key in self._cache:
                return "cached", self._cache[key]
            future, claimed = self._pending.get(key, (None, False))
            if future is not None and claimed:
                return "wait", future
            future = future or Future()
            self._pending[key] = (future, True)
            return "derive", future

    def _derive(self, chosen: tuple[int, ...], future: Future, pause_gc: bool = True) -> MemberPlan:
        key = frozenset(chosen)
        try:
            made = self._made(chosen, pause_gc)
        except BaseException as err:
            with self._lock:
                self._pending.pop(key, None)
            future.set_exception(err)
            raise
        with self._lock:
            made = self._cache.setdefault(key, made)  # a plan planned again meanwhile stays
            self._pending.pop(key, None)
        future.set_result(made)
        return made

    def _chosen(self, engines: Iterable[int]) -> tuple[int, ...]:
        chosen = tuple(sorted(set(engines)))
        if not chosen or not all(0 <= e < len(self.engines) for e in chosen):
            raise PlanError(
                f"engines {list(chosen)}: choose at least one of 0..{len(self.engines) - 1}"
            )
        return chosen

    def _made(self, chosen: tuple[int, ...], pause_gc: bool = True) -> MemberPlan:
        """Derive (or plan again) the set ``chosen``."""
        keep = tuple(sorted(d for e in chosen for d in self.engines[e]))
        t0 = time.perf_counter()
        if len(chosen) == len(self.engines):
            plan, how = self.plan, "full"
        else:
            # the undecorated derivation keeps the collector on (another thread's call)
            derive = derive_plan if pause_gc else derive_plan.__wrapped__  # type: ignore[attr-defined]
            try:
                plan = derive(self.plan, keep, self.spec, self.sources, self.destinations)
                how = "derived"
            except DerivationError as err:
                if self.replan is None:
                    raise
                plan = self.replan(narrowed_layouts(self.destinations, keep), keep)
                how = f"re-planned: {err}"
        return MemberPlan(plan, chosen, keep, how, time.perf_counter() - t0)

    def plan_again(self, engines: Iterable[int]) -> MemberPlan:
        """The set planned afresh with ``replan`` (a derived plan keeps the full plan's
        rounds: at most a few percent slower, ``docs/benchmarks.md``), cached in place of
        the derived one so that the next group made for the set uses it. Slow (a full
        plan): call it off the step's critical path, e.g. in a thread between steps."""
        if self.replan is None:
            raise PlanError("planning again needs MembershipPlans(replan=...)")
        made = self.for_engines(engines)
        if made.how != "derived":
            return made
        t0 = time.perf_counter()
        plan = self.replan(
            narrowed_layouts(self.destinations, made.destinations), made.destinations
        )
        fresh = MemberPlan(plan, made.engines, made.destinations, "planned again",
                           time.perf_counter() - t0)  # fmt: skip
        with self._lock:
            self._cache[frozenset(made.engines)] = fresh
        return fresh
