"""Delta refit: the same compiled rounds, each message sent in its smallest form.

RL updates are sparse at the wire dtype's level (most Adam steps at RL learning rates
are below BF16's rounding step), so most units of a message equal last step's. Per
step, on the same plan and programs (``engine/program.py``):

* a **sender** packs each round as today, compares each distinct outgoing message with
  its *baseline* (that message's payload last step; identical replica messages share
  one), encodes it in its smallest form (``engine/delta/codec.py``) and then makes the
  message its new baseline. Baselines are the only memory delta adds: one copy of what
  the rank sends, on its device or in host memory (``DeltaOptions.baseline``); an
  inference rank that forwards along a chain keeps its baselines in host memory.
* a **receiver** keeps no copy: it writes the changed units of a delta straight into
  its live tensors (``rounds.place``); bytes it could not rebuild from them are
  *fixed* and travel every step.

Every round exchanges the 32-byte headers first, then the payloads at their exact
sizes (a DENSE payload is the staging span itself, received in place).

Versions. Each rank holds a version: a sender the step its baselines hold, a receiver
the step its live tensors hold; :data:`UNKNOWN` for a new, restarted or emptied one
(a colocated engine woken from sleep mode), :data:`FAILED` after a failed step. A new
group whose every rank holds one version whole (engines admitted between steps,
``integrations/worker/membership.py``) is primed with it (:meth:`DeltaProgram.prime`):
its first step goes as deltas too. A step
begins with every rank's version (one all-gather) and applies version
``max(versions) + 1``. A message goes as a delta only if its sender and receiver hold
the same version ``>= 0`` (its fixed bytes always travel); otherwise dense. Any
:data:`FAILED` rank makes the whole step dense, as does every ``anchor_every``-th
version. A failed step leaves its ranks
:data:`FAILED` (baselines half-updated, weights torn).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ...plan import RankPlan, RefitPlan
from ..program import CopyPhase, RankProgram, copy_pairs
from ..transport import Transport
from . import kernels as delta_kernels
from .check import baseline_fingerprints, exchange_fingerprints, round_fingerprints
from .codec import (
    DENSE,
    FORM_NAMES,
    GAPS,
    HEADER_BYTES,
    Header,
    apply_patch,
    changed_units,
    choose_form,
    count_long_gaps,
    decode,
    encode,
    payload_bytes,
    payload_values,
    put_units,
    take_units,
    with_ranges,
)
from .compiled import Changes, CompiledSender
from .options import (
    BASELINE_PLACES,
    FAILED,
    UNKNOWN,
    DeltaError,
    DeltaOptions,
    DeltaStats,
    choose_baseline_place,
)
from .rounds import Fixed, Outgoing, compile_rounds, place, place_gaps
from .stream import stream_round

# (the options and stats live apart; importers take them from here too)
__all__ = [
    "BASELINE_PLACES", "FAILED", "UNKNOWN", "DeltaError", "DeltaOptions", "DeltaProgram",
    "DeltaStats",
]  # fmt: skip


class DeltaProgram:
    """A compiled :class:`RankProgram` replayed with deltas (module docstring)."""

    def __init__(
        self,
        program: RankProgram,
        plan: RefitPlan | RankPlan,
        options: DeltaOptions | None = None,
        held_from_all_but: int | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``held_from_all_but``: a colocated host's receiving half of its guest
        (``engine/colocated.py``): it receives every message but its own (the host's
        rank), and keeps a copy of each in host memory in place of re-packing; ``device``
        then is the host's (the guest's program is bound to shapes only)."""
        self.program, self.options = program, options or DeltaOptions()
        self.device = device or program.device
        self.rank = program.group_rank
        self.is_source = program.is_source
        self.version = UNKNOWN
        self.rounds, self.fixed_in = compile_rounds(program, plan, held_from_all_but)
        self.held: dict[tuple[int, int], torch.Tensor] = {}  # (round, peer) -> last message
        if held_from_all_but is not None:
            self.fixed_in = []
            for k, rnd in enumerate(self.rounds):
                for i in rnd.incoming:
                    self.held[(k, i.peer)] = self._baseline(i.span.numel(), host=True)
        # (dst, round) -> byte ranges of that message its receiver cannot re-pack
        self.fixed_out: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {}
        self.baselines: dict[int, torch.Tensor] = {}
        self._encoded = torch.empty(
            program.send_buffers[0].numel(), dtype=torch.uint8, device=self.device
        )
        self._received = torch.empty(
            program.recv_buffers[0].numel(), dtype=torch.uint8, device=self.device
        )
        self.last = DeltaStats()
        # CPU ranks with numba: the compiled kernels (a sender's built in learn_fixed)
        self.compiled = self.device.type == "cpu" and delta_kernels.use_numba(
            self.options.cpu_kernel
        )
        self.sender: CompiledSender | None = None
        # Each delta's base checked against its receiver's live tensors (delta/check.py):
        # the fingerprints of the baselines, and this step's messages found stale.
        # (default: on for a GPU rank, where it reads at HBM speed; the group runs it only
        # when every rank asks, engine/refit.py)
        wanted = self.options.check
        if wanted is None:
            wanted = self.device.type == "cuda"
        self.check = wanted
        self.base_fingerprints: dict[tuple[int, int], torch.Tensor] = {}
        self._stale: set[tuple[int, int]] = set()
        self._step_prints: dict[tuple[int, int], torch.Tensor] = {}  # this step's, so far
        # CPU: apply each message as it arrives (delta/stream.py); GPU: the round batched
        self.stream = self.device.type == "cpu"
        # round 0 compared while the versions were gathered: (found, bytes of payloads)
        self._ahead: tuple[dict[int, Changes], int] | None = None
        # one thread per program, not shared: ranks of one process (tests run a group
        # on threads) gather at once, and a shared thread would queue one behind another
        self._gathering = ThreadPoolExecutor(1, thread_name_prefix="refit-versions")

    def learn_fixed(self, fixed: Sequence[Sequence[Fixed]]) -> None:
        """Every rank's ``fixed_in`` (by refit rank): the byte ranges of this rank's
        messages that always travel (their receiver cannot re-pack them). Allocate the
        baselines of the messages that can travel as deltas, each distinct one once."""
        self.fixed_out = {
            (dst, k): tuple((a, b) for a, b in ranges)
            for dst, entries in enumerate(fixed)
            for src, k, ranges in entries
            if src == self.rank
        }
        sizes: dict[int, int] = {}
        for k, rnd in enumerate(self.rounds):
            for out in rnd.outgoing:
                if out.key in sizes or _all_fixed(self.fixed_out.get((out.peer, k)), out):
                    continue
                sizes[out.key] = out.span.numel()
        # An inference rank forwarding along a chain keeps its baselines in host memory:
        # no second copy of the model on an inference GPU.
        self.baseline_place = (
            choose_baseline_place(self.options.baseline, self.device, sum(sizes.values()))
            if self.is_source
            else "host"
        )
        for key, nbytes in sizes.items():
            self.baselines[key] = self._baseline(nbytes, self.baseline_place == "host")
        if self.compiled and self.baselines:
            self.sender = CompiledSender(self.program, self.rounds, self.baselines)
        if self.compiled:
            units = {m.unit for rnd in self.rounds for m in [*rnd.outgoing, *rnd.incoming]}
            delta_kernels.warm(units)

    def _baseline(self, nbytes: int, host: bool) -> torch.Tensor:
        pinned = host and self.device.type == "cuda"
        device = "cpu" if host else self.device
        return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pinned)

    @property
    def baseline_bytes(self) -> int:
        """Bytes this rank keeps: its baselines (and a colocated host's held messages)."""
        held = sum(b.numel() for b in self.held.values())
        return sum(b.numel() for b in self.baselines.values()) + held

    def prime(self, version: int) -> bool:
        """This rank's live tensors hold ``version`` whole, and so do every other rank's
        (a new group of a run whose engines changed, joined between steps): take each
        outgoing message's baseline from them, so that the next step can go as deltas
        instead of dense. A colocated host's held messages are not rebuilt: it stays
        dense (False)."""
        if self.held:
            return False
        with torch.no_grad():
            for k, phase in enumerate(self.program.rounds):
                outgoing = {o.key: o for o in self.rounds[k].outgoing if o.key in self.baselines}
                if not outgoing:
                    continue
                phase.pack_wire()
                for o in outgoing.values():
                    self.baselines[o.key].copy_(o.span)
            self._fingerprint_baselines()
        self.version = version
        return True

    def _fingerprint_baselines(self) -> None:
        if self.check:
            self.base_fingerprints = baseline_fingerprints(self)

    def gather_versions(self, gather: Callable[[], Sequence[int]]) -> list[int]:
        """Every rank's version (``gather``: the group's collective, which has read this
        rank's version already: it runs on another thread). A compiled CPU sender holding
        a version compares round 0's direct messages meanwhile (``CompiledSender.ahead``):
        the gather's latency hides behind the compare, whatever versions it brings (a
        message that goes dense goes from its baseline, which holds it)."""
        self._ahead = None
        if self.sender is None or self.version < 0 or not self.rounds:
            return list(gather())
        pending = self._gathering.submit(gather)
        self.version = FAILED  # the baselines move now: torn until the step is done
        try:
            with torch.no_grad():
                self._ahead = self.sender.ahead(
                    self.rounds[0].outgoing, self.baselines, self._encoded
                )
        finally:
            versions = list(pending.result())  # (a failed gather raises here)
        return versions

    def begin(self, versions: Sequence[int]) -> tuple[int, bool]:
        """The step's version and whether it is dense for everyone (module docstring);
        this rank is FAILED until :meth:`done`."""
        version = max(versions) + 1
        anchor = bool(self.options.anchor_every) and version % self.options.anchor_every == 0
        self.version = FAILED
        self._step_prints = {}
        return version, anchor or FAILED in versions

    def done(self, stats: DeltaStats) -> DeltaStats:
        if self.check and self.sender is None:
            # taken round by round from the staging, on the device (encode_round)
            self.base_fingerprints, self._step_prints = self._step_prints, {}
        else:
            with torch.no_grad():
                self._fingerprint_baselines()
        self.version, self.last = stats.version, stats
        self._stale = set()
        return stats

    def replay(self, transport: Transport, versions: Sequence[int]) -> DeltaStats:
        """One refit step given every rank's version; on success this rank holds the
        step's version. Serial rounds: headers, then payloads; on CPU each message is
        applied as it arrives (``delta/stream.py``), on a GPU after the round's last."""
        version, dense_step = self.begin(versions)
        stats = DeltaStats(version=version)
        mine = versions[self.rank]
        with torch.no_grad():
            if self.check and not dense_step:
                self._stale, stats.check_bytes = exchange_fingerprints(
                    self, transport, versions, mine
                )
                stats.stale = len(self._stale)
            for k, phase in enumerate(self.program.rounds):
                sends = self.encode_round(k, mine, versions.__getitem__, dense_step, stats, phase)
                if self.stream:
                    land = functools.partial(self.land, k, mine=mine, stats=stats)
                    incoming = self.rounds[k].incoming
                    stream_round(transport, k, phase, sends, incoming, land, self.apply)
                    continue
                headers = self.exchange_headers(transport, k, sends, self.rounds[k].incoming)
                recvs, patches = self.receive_plan(k, headers, mine, stats)
                transport.exchange(
                    [(peer, p) for peer, _, p in sends if p.numel()],
                    [(peer, buf) for peer, buf in recvs if buf.numel()],
                    k,
                )
                self.unpack(phase, patches)
        return self.done(stats)

    def exchange_headers(self, transport: Transport, k: int, sends, incoming) -> list:
        """Send each outgoing message's header, receive each incoming one's."""
        headers = [torch.empty(HEADER_BYTES, dtype=torch.uint8) for _ in incoming]
        headers = [h.to(self.device) for h in headers]
        transport.exchange(
            [(peer, h) for peer, h, _ in sends],
            [(i.peer, h) for i, h in zip(incoming, headers)],
            k,
        )
        return headers

    def unpack(self, phase: CopyPhase, patches) -> None:
        """The round's unpack with deltas: dense messages copied as compiled (in one
        dispatch), each delta applied to the live tensors (:meth:`apply`)."""
        for job in phase.before_in:
            job()
        copy_pairs([pair for i, header, _ in patches if header.form == DENSE for pair in i.pairs])
        for patch in patches:
            if patch[1].form != DENSE:
                self.apply(patch)
        for job in phase.after_in:
            job()

    def apply(self, patch) -> None:
        """One received message ``(incoming, header, payload)`` into the live tensors:
        DENSE as compiled; a delta's changed units (``rounds.place``, or the
        compiled kernel straight from a GAPS payload's gap bytes)."""
        incoming, header, payload = patch
        if header.form == DENSE:
            copy_pairs(incoming.pairs)
            return
        if not header.count:
            return
        if header.form == GAPS and self.compiled:
            if place_gaps(incoming, payload, header.count):
                return
        n, unit = incoming.span.numel(), incoming.unit
        index, values = decode(payload, header, n, unit, self.compiled)
        place(incoming, index, values, self.compiled)

    def patch(self, k: int, patches) -> None:
        """A colocated host: rebuild each delta message for its guest in its span (the
        copy it holds, then the changed units), then hold every message received."""
        for incoming, header, payload in patches:
            held = self.held[(k, incoming.peer)]
            if header.form != DENSE:
                incoming.span.copy_(held)
                apply_patch(incoming.span, payload, header, incoming.unit)
            held.copy_(incoming.span)

    def encode_round(
        self,
        k: int,
        mine: int,
        version_of: Callable[[int], int],
        dense_step: bool,
        stats: DeltaStats,
        phase: CopyPhase | None = None,
    ) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(peer, header bytes, payload)`` per outgoing message of round ``k``;
        ``mine``: this rank's version, ``version_of(peer)`` each receiver's. ``phase``:
        pack the round here, all but the messages the compiled kernel reads where they
        live; None: the caller packed it. Baselines then hold the round's messages."""
        rnd = self.rounds[k]
        delta_to = [
            not dense_step
            and mine >= 0
            and version_of(o.peer) == mine
            and o.key in self.baselines
            and (k, i) not in self._stale  # its receiver holds other bytes (delta/check.py)
            for i, o in enumerate(rnd.outgoing)
        ]
        # Changed units of each distinct message (bits, against its baseline): numpy's
        # indices, or the kernel's Changes (its baseline then holds the message; round 0's
        # may have been found while the versions were gathered).
        changed: dict[int, torch.Tensor] = {}
        found, at = self._ahead if k == 0 and self._ahead else ({}, 0)
        self._ahead = None
        delta_keys = {o.key for o, d in zip(rnd.outgoing, delta_to) if d}
        if phase is not None and self.sender is not None:
            self.sender.pack(k, phase, delta_keys | found.keys())
        elif phase is not None:
            phase.pack()
        packed = phase is None
        if self.sender is not None:  # every message compared before any is sent
            at = self.sender.compare_round(
                k, rnd.outgoing, delta_keys, self.baselines, self._encoded, packed, found, at
            )
        else:
            for o, delta in zip(rnd.outgoing, delta_to):
                if delta and o.key not in changed:
                    changed[o.key] = changed_units(o.span, self.baselines[o.key], o.unit)
                    stats.units += o.span.numel() // o.unit
                    stats.changed += changed[o.key].numel()
        sends, encoded = [], {}
        for o, delta in zip(rnd.outgoing, delta_to):
            n = o.span.numel()
            if delta:
                variant = (o.key, self.fixed_out.get((o.peer, k), ()))
                if variant not in encoded:
                    out = self._encoded[at:]
                    if self.sender is not None:
                        baseline = self.baselines[o.key]
                        encoded[variant] = self.sender.encode(o, variant[1], out, found, baseline)
                    else:
                        index = with_ranges(changed[o.key], variant[1], o.unit)
                        count, long_gaps = index.numel(), count_long_gaps(index)
                        form = choose_form(n, o.unit, count, long_gaps)
                        if payload_bytes(form, n, o.unit, count, long_gaps) > out.numel():
                            form = DENSE  # (the round's payloads fill the scratch)
                        encoded[variant] = (form, count, encode(o.span, index, o.unit, form, out))
                    form, _, payload = encoded[variant]
                    if form != DENSE and payload.data_ptr() == out.data_ptr():
                        at += payload.numel()  # (a payload built ahead lies before)
                form, count, payload = encoded[variant]
                header = Header(form, mine if form != DENSE else UNKNOWN, count, payload.numel())
            else:
                # a direct message compared for another receiver was never packed: its
                # baseline holds it
                whole = self.baselines[o.key] if o.key in found else o.span
                form, payload, header = DENSE, whole, Header(DENSE, UNKNOWN, 0, n)
            raw = torch.empty(HEADER_BYTES, dtype=torch.uint8)
            header.write(raw)
            sends.append((o.peer, raw.to(self.device), payload))
            stats.forms[FORM_NAMES[form]] = stats.forms.get(FORM_NAMES[form], 0) + 1
            stats.sent_bytes += HEADER_BYTES + payload.numel()
            stats.dense_bytes += n
        for key in delta_keys & found.keys():
            stats.units += self.baselines[key].numel() // found[key].unit
            stats.changed += found[key].count
        self._update_baselines(rnd.outgoing, changed, found, encoded)
        if self.check and self.sender is None:
            # the spans hold what the baselines now hold: fingerprinted where they are
            # (the compiled CPU sender leaves direct messages unpacked: done() reads its
            # baselines instead)
            self._step_prints.update(round_fingerprints(self, k, staged=True))
        return sends

    def _update_baselines(self, outgoing: list[Outgoing], changed, found, encoded) -> None:
        """The baselines become this round's messages (after every encode read them):
        where numpy compared a message, only its changed units differ; a payload that
        carries exactly those units gives their bytes (no second gather). The kernel's
        baselines are updated already."""
        for o in {o.key: o for o in outgoing if o.key in self.baselines}.values():
            if o.key in found:
                continue
            baseline, index = self.baselines[o.key], changed.get(o.key)
            if index is None:
                baseline.copy_(o.span)
                continue
            form, count, payload = encoded.get((o.key, ()), (None, 0, None))
            if form == DENSE:
                baseline.copy_(o.span)
            elif form is not None:
                values = payload_values(payload, form, o.span.numel(), o.unit, count)
                put_units(baseline, index, values, o.unit)
            else:  # every variant sent carried fixed ranges too
                put_units(baseline, index, take_units(o.span, index, o.unit), o.unit)

    def receive_plan(self, k: int, headers, mine: int, stats: DeltaStats):
        """Where each payload of round ``k`` lands, given its header (:meth:`land`)."""
        recvs, patches, at = [], [], 0
        for incoming, raw in zip(self.rounds[k].incoming, headers):
            buf, patch, at = self.land(k, incoming, raw, at, mine, stats)
            recvs.append((incoming.peer, buf))
            patches.append(patch)
        return recvs, patches

    def land(self, k: int, incoming, raw: torch.Tensor, at: int, mine: int, stats: DeltaStats):
        """Where one payload of round ``k`` lands, given its header ``raw``: a DENSE one
        in its span, a delta in scratch from byte ``at``; ``mine``: this rank's version.
        ``(buffer, (incoming, header, buffer), the next free scratch byte)``."""
        header = Header.read(raw)
        n = incoming.span.numel()
        name = FORM_NAMES[header.form]
        stats.received[name] = stats.received.get(name, 0) + 1
        if header.form == DENSE:
            if header.nbytes != n:
                raise DeltaError(
                    f"refit rank {self.rank}: round {k}: rank {incoming.peer} sends a "
                    f"{header.nbytes}-byte dense message where the plan has {n}; the two "
                    "ranks compiled different plans"
                )
            return incoming.span, (incoming, header, incoming.span), at
        if header.base != mine or header.nbytes > n:
            raise DeltaError(
                f"refit rank {self.rank}: round {k}: rank {incoming.peer} sent a delta "
                f"against version {header.base}, this rank holds version {mine}; the "
                "group disagrees on versions (a bug: report it)"
            )
        payload = self._received[at : at + header.nbytes]
        return payload, (incoming, header, payload), at + header.nbytes


def _all_fixed(ranges, out: Outgoing) -> bool:
    """Ranges that cover the whole message: its receiver can re-pack none of it."""
    return bool(ranges) and sum(b - a for a, b in ranges) >= out.span.numel()
