"""Deriving the plan for a set of engines from the full plan (``membership.py`` caches them).

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

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from operator import itemgetter, methodcaller

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
from .pass6_messages import Message
from .pass7_assemble import baseline_bytes, count_deliveries
from .result.expand import Expansion
from .result.refit_plan import PlanStats, RefitPlan

_SRC_TENSOR = itemgetter(2)
_STARTS_RELAY = methodcaller("startswith", RELAY)


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
    counts = count_deliveries(rounds, expansion, s + len(destinations), full.fp8_block)
    # Every destination receives exactly what it stores, and a carrier also what it
    # carries: the floor is what the remaining destinations receive, less that.
    min_bytes = sum(counts.received[s:]) - sum(counts.carried_in[s:])
    # identical layouts counted once per class, as pass 1's groups are
    classes = tuple(sorted({tuple(s + r for r in lay.replicas) for lay in destinations}))
    baseline = baseline_bytes(spec, sources, destinations, classes)
    return counts.stats(min_bytes, baseline, expansion.num_rounds)
