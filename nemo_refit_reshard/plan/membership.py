"""A plan per set of engines, cached: :class:`MembershipPlans` (and :class:`MemberPlan`).

The inference side of a refit group can change between steps (an engine fenced after a
failure, one admitted, ``integrations/worker/membership.py``). The plan for the engines
left is derived from the full plan (``derive_members.py``: 4-5 s for DeepSeek-V3 256→256
on one core, where ``plan_refit`` takes 31 s), or planned again with the full plan's
settings where derivation cannot express the set; each set once, cached, and the sets of
one engine fewer derived ahead in a thread, off the step's critical path.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..layouts.base import RankLayout
from ..spec.model import ModelSpec
from .base import PlanError
from .cluster import Placement, Topology
from .colocation import Colocation
from .derive_members import DerivationError, derive_plan, narrowed_layouts
from .result.refit_plan import RefitPlan

__all__ = [
    "DerivationError",
    "MemberPlan",
    "MembershipPlans",
    "derive_plan",
    "narrowed_layouts",
]


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
    # the sets whose plans stay cached (None: all): keep_only's, and any asked for since
    _keep: set[frozenset[int]] | None = field(default=None, repr=False)

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
        with self._lock:  # asked for: kept until the next keep_only
            if self._keep is not None:
                self._keep.add(frozenset(chosen))
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
        queued: list[tuple[tuple[int, ...], Future]] = []
        with self._lock:
            for chosen in wanted:
                key = frozenset(chosen)
                if self._keep is not None:
                    self._keep.add(key)
                if key not in self._cache and key not in self._pending:
                    future: Future = Future()
                    self._pending[key] = (future, False)  # queued, not claimed
                    queued.append((chosen, future))
        done: Future = Future()

        def run() -> None:
            count = 0
            for chosen, future in queued:
                if self._claim_queued(frozenset(chosen), future):
                    # the collector stays on: gc.disable() is process-wide, and this
                    # thread runs beside the driver
                    self._derive(chosen, future, pause_gc=False)
                    count += 1
            done.set_result(count)

        try:
            threading.Thread(target=run, name="derive-ahead", daemon=True).start()
        except BaseException as err:  # no thread: nobody may wait on these sets
            with self._lock:
                for chosen, future in queued:
                    if self._pending.get(frozenset(chosen), (None,))[0] is future:
                        del self._pending[frozenset(chosen)]
                    future.set_exception(err)
            raise
        return done

    def _claim_queued(self, key: frozenset[int], future: Future) -> bool:
        """Whether the derive-ahead thread derives ``key`` now: not if someone else took
        it (derived it, or is deriving it), nor if keep_only dropped it before it was
        started (then it is forgotten unbuilt: nobody waits on an unclaimed set)."""
        with self._lock:
            entry = self._pending.get(key)
            if entry is None or entry[0] is not future or entry[1]:
                return False
            if not self._wanted(key):
                del self._pending[key]
                future.cancel()
                return False
            self._pending[key] = (future, True)
            return True

    def _wanted(self, key: frozenset[int]) -> bool:
        return self._keep is None or key in self._keep

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
            if self._wanted(key):  # not dropped by keep_only meanwhile
                made = self._cache.setdefault(key, made)  # one planned again meanwhile stays
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

    def cached_sets(self) -> list[tuple[int, ...]]:
        """The sets of engines whose plans are cached, sorted."""
        with self._lock:
            return sorted(tuple(sorted(key)) for key in self._cache)

    def keep_only(self, sets: Iterable[Iterable[int]]) -> int:
        """Drop every cached plan but those of ``sets`` (the full plan stays: it is the
        one the others derive from); returns how many were dropped. A driver calls it as
        membership changes so that the cache holds the plans the next failure can need
        (the set serving and each set of it less one), not one per set ever served. Sets
        asked for later (``for_engines``, ``derive_ahead``) join the kept ones until the
        next call; a dropped set being derived ahead is not cached when done, nor started
        if it was only queued; ``plan_again`` caches its plan only if the set is kept."""
        keep = {frozenset(self._chosen(engines)) for engines in sets}
        keep.add(frozenset(range(len(self.engines))))
        with self._lock:
            drop = [key for key in self._cache if key not in keep]
            for key in drop:
                del self._cache[key]
            # sets still being derived ahead are not cached when done, nor started if queued
            self._keep = keep
        return len(drop)

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
            if self._wanted(frozenset(made.engines)):  # not dropped by keep_only meanwhile
                self._cache[frozenset(made.engines)] = fresh
        return fresh
