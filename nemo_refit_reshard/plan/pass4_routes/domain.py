"""``relay="domain"`` routes: where each transfer enters its group's relay runs.

Pass 2 split each replica group into *runs* (members sharing an NVLink domain, or rings
across nodes, ``pass2_fanout.py``). Training ranks send each transfer once per run,
entering at a balanced position of the run, and the run forwards it around, one hop
per round (``result/expand.py``), so every member's NIC brings in a share and the
training pool sends one copy per domain instead of one per replica.
"""

from __future__ import annotations

import functools
import heapq
from collections import defaultdict
from itertools import repeat
from operator import add, itemgetter, mod, mul, sub

from ..base import Transfer, new_transfer, sizes_of


@functools.lru_cache(maxsize=64)
def entry_weights(widths: tuple[int, ...], units: int = 64) -> list[float]:
    """Share of a group's data to enter at each position ``j`` of its widest run.

    Position ``j`` enters run ``k`` (``widths[k]`` members) at member ``j mod w_k``, so a
    narrower run's members can stand for several positions. Water-filling ``units`` per
    position, each to the position whose busiest entry member stays lowest (then whose
    entry members are least loaded in total), spreads
    every run's share evenly over its members as far as the widths allow (widths 9 and
    7: each of the 7 takes 1/7, the 9 take 1/7 or 1/14)."""
    width = widths[0]
    load = [[0] * w for w in widths]
    weights = [0] * width
    for _ in range(units * width):
        j = min(range(width), key=lambda j: _entry_cost(load, j))
        weights[j] += 1
        for ld in load:
            ld[j % len(ld)] += 1
    return [w / (units * width) for w in weights]


def _entry_cost(load: list[list[int]], j: int) -> tuple[int, int, int]:
    # The busiest entry member first, then the least loaded in total (so members that
    # several positions share do not leave their other positions idle), then order.
    at = [ld[j % len(ld)] for ld in load]
    return max(at), sum(at), j


_SRC, _DST = itemgetter(0), itemgetter(1)  # a transfer's sender and receiver


def _largest_first(sizes: list[int], dsts: list[int], srcs: list[int]) -> list[int]:
    """Positions ``i`` ordered by ``(-sizes[i], dsts[i], srcs[i], i)``, sorted as one
    integer each, ``((top - size) * ranks + dst) * ranks + src) * n + i``, which orders
    exactly as the tuple does (every part within its range) and sorts several times
    faster than tuples (1.5 million transfers at DeepSeek-V3 scale)."""
    n = len(sizes)
    if not n:
        return []
    top, ranks = max(sizes), max(max(dsts), max(srcs)) + 1
    keys = map(sub, repeat(top), sizes)
    keys = map(add, map(mul, keys, repeat(ranks)), dsts)
    keys = map(add, map(mul, keys, repeat(ranks)), srcs)
    keys = map(add, map(mul, keys, repeat(n)), range(n))
    return list(map(mod, sorted(keys), repeat(n)))


def domain_entries(
    transfers: list[Transfer], runs_of: dict[int, list[tuple[int, ...]]]
) -> tuple[list[Transfer], dict[int, tuple[int, ...]]]:
    """Where each transfer enters its destination's domains, for ``relay="domain"``.

    ``runs_of[rep]`` are the runs (members sharing an NVLink domain, widest first) of a
    replica group. Transfers to ``rep``, largest first, go to the position ``j`` of the
    widest run furthest below its share (:func:`entry_weights`) and are re-addressed to
    that member; in every other run they enter at member ``j mod width``. So each member
    of a run brings in an even part of its data through its own NIC, and forwards the
    rest around the run (``result/expand.py``). Returns the re-addressed transfers and,
    per entry member, every run's entry for it (the receivers a sender serves with one
    stored transfer).
    """
    sizes = list(sizes_of(transfers))
    order = _largest_first(sizes, list(map(_DST, transfers)), list(map(_SRC, transfers)))
    total: dict[int, int] = defaultdict(int)
    for dst, nbytes in zip(map(_DST, transfers), sizes):
        total[dst] += nbytes
    heaps: dict[int, list[tuple[float, int]]] = {}
    for rep, runs in runs_of.items():
        weights = entry_weights(tuple(len(run) for run in runs))
        # (-(share still due), position): the most-behind position first
        heaps[rep] = [(-w * total[rep], j) for j, w in enumerate(weights)]
        heapq.heapify(heaps[rep])
    out = list(transfers)
    heapreplace = heapq.heapreplace
    # (the order is by receiver within a size: its runs and heap are looked up per run)
    run_dst, heap, entries = -1, None, None
    for i in order:
        t = transfers[i]
        if t[1] != run_dst:
            run_dst = t[1]
            runs = runs_of.get(run_dst)
            heap, entries = (None, None) if runs is None else (heaps[run_dst], runs[0])
        if heap is None:
            continue
        due, j = heap[0]
        heapreplace(heap, (due + sizes[i], j))
        out[i] = new_transfer(Transfer, (t[0], entries[j], *t[2:]))  # (``_replace``, cheaper)
    targets = {
        run0[j]: tuple(run[j % len(run)] for run in runs)
        for runs in runs_of.values()
        for run0 in runs[:1]
        for j in range(len(run0))
    }
    return out, targets
