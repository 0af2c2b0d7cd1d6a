"""What a fill (``fill.py``) needs of its pairs that no round budget changes:
``budget.py`` fills several budgets side by side, each over its own clones of one
list of pairs, and builds this once for all of them."""

from __future__ import annotations

from collections import defaultdict

from .pair_loads import Pair, capacity_terms


class FillSetup:
    """What a fill needs of its pairs that no round budget changes, by pair index: built
    once for the fills of one list of pairs (``budget.py`` fills several budgets,
    each over its own clones of the same list)."""

    def __init__(self, pairs: list[Pair], latency: list[float]) -> None:
        # Per pair, the first pair with its capacity terms (``pair_loads.capacity_terms``,
        # and how many of them its own round has): what a budget lets one round take of a
        # pair depends on nothing else, and most pairs share them with many others.
        first: dict[tuple, int] = {}
        self.same_capacity = [
            first.setdefault(
                (*map(tuple, capacity_terms(p, latency)), len(p.now_time), len(p.now_staging)), i
            )
            for i, p in enumerate(pairs)
        ]
        self.capacity_firsts = list(first.values())
        by_src: dict[int, list[int]] = defaultdict(list)
        for i, p in enumerate(pairs):
            by_src[p.src].append(i)
        self.by_src = dict(by_src)  # sender -> its pairs, in order
        # What every pair has left at the start: its sender's link time, and each
        # receiving link's (time index) work, so that a pair ranks by its busiest
        # receiver, members that several stored receivers share seen as the sum of them.
        self.send_left = {
            s: sum(float(pairs[i].nbytes) * pairs[i].send_cost for i in ids)
            for s, ids in by_src.items()
        }
        recv_left: dict[int, float] = defaultdict(float)
        for p in pairs:
            for idx, c in p.recv:
                recv_left[idx] += float(p.nbytes) * c
        self.recv_left = dict(recv_left)
        # Each sender's pairs in turn from a different receiver: the order between equals.
        self.rank_in = [0] * len(pairs)
        for i, src in enumerate(sorted(by_src)):
            ids = by_src[src]
            k = i * len(ids) // len(by_src)
            for j, x in enumerate(ids[k:] + ids[:k]):
                self.rank_in[x] = j
        self.horizon = max(p.horizon for p in pairs)
        # Pairs numbered by receiver set (many pairs share one), and the sets holding
        # each time index.
        set_id: dict[tuple[int, ...], int] = {}
        self.receiver_set = [set_id.setdefault(p.rkey, len(set_id)) for p in pairs]
        self.receiver_sets = list(set_id)
        self.sets_with: dict[int, list[int]] = defaultdict(list)
        for rset, rkey in enumerate(self.receiver_sets):
            for idx in set(rkey):
                self.sets_with[idx].append(rset)
        # Each set's busiest receiver's work at the start, and each sender's pairs by it
        # (negated) and rotation: a fill's first heaps.
        self.priorities = [max(recv_left[i] for i in rkey) for rkey in self.receiver_sets]
        self.heaps = {
            s: [(-self.priorities[self.receiver_set[i]], self.rank_in[i], i) for i in ids]
            for s, ids in by_src.items()
        }
        # A pair's receivers' time and staging bits in one mask (time bits below
        # ``shift``).
        self.shift = 2 * len(latency)
        self.gates = [p.gate_mask | p.sgate_mask << self.shift for p in pairs]
        # Each sender's pairs grouped by what a byte of them costs its own links (their
        # ``now_time`` terms on its out keys) and their chunk: (terms, chunk, the pairs, those
        # with fewer bytes than a chunk).
        self.groups: dict[int, list[tuple[tuple, float, list[int], list[int]]]] = {}
        self.own: dict[int, tuple[int, int]] = {}  # sender -> (its out keys, staging bit)
        for src, ids in by_src.items():
            by_terms: dict[tuple, tuple[tuple, float, list[int], list[int]]] = {}
            for i in ids:
                p = pairs[i]
                terms = tuple(t for t in p.now_time if t[0] % 2 == 0)
                g = by_terms.get((terms, p.chunk))
                if g is None:
                    g = by_terms[(terms, p.chunk)] = (terms, p.chunk, [], [])
                g[2].append(i)
                if float(p.nbytes) < p.chunk:
                    g[3].append(i)
            self.groups[src] = list(by_terms.values())
            keys = {idx for g in by_terms.values() for idx, _, _, _ in g[0]}
            self.own[src] = (sum(1 << k for k in keys), 1 << (2 * src))
