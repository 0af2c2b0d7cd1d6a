"""Delta refit: the same compiled rounds, each message sent in its smallest form.

RL updates are sparse at the wire dtype's level (most Adam steps at RL learning rates
are below BF16's rounding step), so most units of a message equal last step's. Per
step, on the same plan and programs (``engine/program.py``):

* a **sender** packs each round as today, compares each distinct outgoing message with
  its *baseline* (that message's payload last step; identical replica messages share
  one), encodes it in its smallest form (``engine/delta_codec.py``) and then makes the
  message its new baseline. Baselines are the only memory delta adds: one copy of what
  the rank sends, on its device or in host memory (``DeltaOptions.baseline``).
* a **receiver** keeps no copy: for a delta message it re-packs the message's previous
  content from its live tensors into the receive span (the unpack's copies reversed),
  patches the changed units in, and unpacks as today.

Every round exchanges the 32-byte headers first, then the payloads at their exact
sizes (a DENSE payload is the staging span itself, received in place).

Versions. Each rank holds a version: a sender the step its baselines hold, a receiver
the step its live tensors hold; :data:`UNKNOWN` for a new, restarted or emptied one
(a colocated engine woken from sleep mode), :data:`FAILED` after a failed step. A step
begins with every rank's version (one all-gather) and applies version
``max(versions) + 1``. A message goes as a delta only if its sender and receiver hold
the same version ``>= 0``, its sender is a training rank and its receiver can re-pack it
(its runs land in live tensors of the wire dtype: not a relay buffer, not an FP8
engine's BF16 shadow); otherwise dense. Any :data:`FAILED` rank makes the whole step
dense, as does every ``anchor_every``-th version. A failed step leaves its ranks
:data:`FAILED` (baselines half-updated, weights torn).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..plan import RankPlan, RefitPlan, is_relay
from .delta_codec import (
    DENSE,
    FORM_NAMES,
    HEADER_BYTES,
    Header,
    apply_patch,
    changed_counts,
    changed_mask,
    choose_form,
    encode,
    unit_of,
)
from .program import TORCH_DTYPES, RankProgram, copy_pairs
from .transport import Transport

UNKNOWN = -1
FAILED = -2
BASELINE_PLACES = ("device", "host")


class DeltaError(RuntimeError):
    """A delta arrived that this rank cannot apply (the ranks disagree on versions)."""


@dataclass(frozen=True)
class DeltaOptions:
    """``anchor_every``: a dense step every that many versions (0: only when needed).
    ``baseline``: where senders keep their baselines, ``"device"`` (the staging's) or
    ``"host"`` (pinned host memory when the device is a GPU)."""

    anchor_every: int = 0
    baseline: str = "device"

    def __post_init__(self) -> None:
        if self.anchor_every < 0:
            raise ValueError(f"delta anchor_every={self.anchor_every} must be >= 0")
        if self.baseline not in BASELINE_PLACES:
            raise ValueError(
                f"delta baseline={self.baseline!r}: choose one of {list(BASELINE_PLACES)}"
            )


@dataclass
class DeltaStats:
    """One step's delta on this rank: messages and payload bytes by form, units changed."""

    version: int = UNKNOWN
    sent_bytes: int = 0  # payloads + headers this rank sent
    dense_bytes: int = 0  # what the same messages weigh dense (without headers)
    units: int = 0  # units compared (delta-capable outgoing messages)
    changed: int = 0
    forms: dict[str, int] = field(default_factory=dict)  # outgoing messages by form


@dataclass
class _Outgoing:
    peer: int
    span: torch.Tensor
    unit: int
    key: int  # index of its distinct span (shared by identical replica messages)


@dataclass
class _Incoming:
    peer: int
    span: torch.Tensor
    unit: int
    repack: list[tuple[torch.Tensor, torch.Tensor]] | None  # (staged, live); None: dense only


@dataclass
class _Round:
    outgoing: list[_Outgoing]
    incoming: list[_Incoming]


def _repackable(message, expected: Mapping, shadows: set[str]) -> bool:
    """A receiver can rebuild ``message``'s previous bytes from its live tensors."""
    for t in message.transfers:
        if is_relay(t.dst_tensor) or t.dst_tensor in shadows:
            return False
        if expected[t.dst_tensor][1] != t.dtype:
            return False
    return True


class DeltaProgram:
    """A compiled :class:`RankProgram` replayed with deltas (module docstring)."""

    def __init__(
        self,
        program: RankProgram,
        plan: RefitPlan | RankPlan,
        options: DeltaOptions | None = None,
    ) -> None:
        self.program, self.options = program, options or DeltaOptions()
        me = self.rank = program.group_rank
        self.is_source = program.is_source
        self.version = UNKNOWN
        expected = plan.expected_tensors(me)
        shadows = {q.weight for q in plan.quantize_steps_of(me) if q.source is None}
        by_round: dict[int, list] = {}
        for m in plan.messages_of(me):
            by_round.setdefault(m.round, []).append(m)
        spans: dict[tuple[int, int], int] = {}
        self.rounds: list[_Round] = []
        self.dense_only_in: list[tuple[int, int]] = []  # (src, round) this rank can't re-pack
        for k, phase in enumerate(program.rounds):
            messages = by_round.get(k, [])
            # (a message packed straight into a co-located receiver's staging: no wire)
            out_msgs = [m for m in messages if m.src == me and (k, m.dst) not in program.local_into]
            in_msgs = [m for m in messages if m.dst == me]
            outgoing = []
            for (peer, span), m in zip(phase.sends, out_msgs, strict=True):
                key = spans.setdefault((span.data_ptr(), span.numel()), len(spans))
                outgoing.append(_Outgoing(peer, span, _unit(m), key))
            incoming = []
            for (peer, span), m in zip(phase.recvs, in_msgs, strict=True):
                repack = None
                if _repackable(m, expected, shadows):
                    repack = [
                        (staged, live)
                        for (live, staged), src in zip(phase.copies_in, phase.copies_in_from)
                        if src == peer
                    ]
                else:
                    self.dense_only_in.append((peer, k))
                incoming.append(_Incoming(peer, span, _unit(m), repack))
            self.rounds.append(_Round(outgoing, incoming))
        self._span_bytes = {key: n for (_, n), key in spans.items()}
        self.dense_only_out: set[tuple[int, int]] = set()  # (dst, round), set by the group
        self.baselines: dict[int, torch.Tensor] = {}
        self._encoded = torch.empty(
            program.send_buffers[0].numel(), dtype=torch.uint8, device=program.device
        )
        self._received = torch.empty(
            program.recv_buffers[0].numel(), dtype=torch.uint8, device=program.device
        )
        self.last = DeltaStats()

    def learn_refusals(self, refusals: Sequence[Sequence[tuple[int, int]]]) -> None:
        """Every rank's ``dense_only_in`` (by refit rank): the messages this rank must
        always send dense; allocate baselines for the rest (a sender that is a training
        rank; an inference rank forwarding along a chain sends dense)."""
        self.dense_only_out = {
            (dst, k) for dst, pairs in enumerate(refusals) for src, k in pairs if src == self.rank
        }
        if not self.is_source:
            return
        pinned = self.options.baseline == "host" and self.program.device.type == "cuda"
        device = "cpu" if self.options.baseline == "host" else self.program.device
        for k, rnd in enumerate(self.rounds):
            for out in rnd.outgoing:
                if (out.peer, k) in self.dense_only_out or out.key in self.baselines:
                    continue
                self.baselines[out.key] = torch.empty(
                    out.span.numel(), dtype=torch.uint8, device=device, pin_memory=pinned
                )

    @property
    def baseline_bytes(self) -> int:
        return sum(b.numel() for b in self.baselines.values())

    def replay(self, transport: Transport, versions: Sequence[int]) -> DeltaStats:
        """One refit step given every rank's version (module docstring); on success this
        rank holds the step's version. Serial rounds: headers, then payloads."""
        version = max(versions) + 1
        anchor = self.options.anchor_every and version % self.options.anchor_every == 0
        dense_step = anchor or FAILED in versions
        stats = DeltaStats(version=version)
        self.version = FAILED  # until the step completes
        with torch.no_grad():
            for k, (phase, rnd) in enumerate(zip(self.program.rounds, self.rounds)):
                phase.pack()
                sends = self._encode_round(k, rnd, versions, dense_step, stats)
                headers = [torch.empty(HEADER_BYTES, dtype=torch.uint8) for _ in rnd.incoming]
                headers = [h.to(self.program.device) for h in headers]
                transport.exchange(
                    [(peer, h) for peer, h, _ in sends],
                    [(i.peer, h) for i, h in zip(rnd.incoming, headers)],
                    k,
                )
                recvs, patches = self._receive_plan(k, rnd, headers, versions)
                transport.exchange(
                    [(peer, p) for peer, _, p in sends if p.numel()],
                    [(peer, buf) for peer, buf in recvs if buf.numel()],
                    k,
                )
                for incoming, header, payload in patches:
                    copy_pairs(incoming.repack or [])
                    apply_patch(incoming.span, payload, header, incoming.unit)
                phase.unpack()
        self.version = version
        self.last = stats
        return stats

    def _encode_round(self, k: int, rnd: _Round, versions, dense_step: bool, stats: DeltaStats):
        """``(peer, header bytes, payload)`` per outgoing message; baselines updated."""
        mine = versions[self.rank]
        delta_to = [
            not dense_step
            and mine >= 0
            and versions[o.peer] == mine
            and o.key in self.baselines
            and (o.peer, k) not in self.dense_only_out
            for o in rnd.outgoing
        ]
        keys = sorted({o.key for o, d in zip(rnd.outgoing, delta_to) if d})
        masks = {}
        for key in keys:
            o = next(o for o in rnd.outgoing if o.key == key)
            masks[key] = changed_mask(o.span, self.baselines[key], o.unit)
        counts = dict(zip(keys, changed_counts(list(masks.values()))))
        encoded: dict[int, tuple[int, torch.Tensor]] = {}
        at = 0
        sends = []
        for o, delta in zip(rnd.outgoing, delta_to):
            n = o.span.numel()
            if delta:
                if o.key not in encoded:
                    form = choose_form(n, o.unit, counts[o.key])
                    payload = encode(o.span, masks[o.key], o.unit, form, self._encoded[at:])
                    if form != DENSE:
                        at += payload.numel()
                    encoded[o.key] = (form, payload)
                    stats.units += n // o.unit
                    stats.changed += counts[o.key]
                form, payload = encoded[o.key]
                header = Header(
                    form, mine if form != DENSE else UNKNOWN, counts[o.key], payload.numel()
                )
            else:
                form, payload, header = DENSE, o.span, Header(DENSE, UNKNOWN, 0, n)
            raw = torch.empty(HEADER_BYTES, dtype=torch.uint8)
            header.write(raw)
            sends.append((o.peer, raw.to(self.program.device), payload))
            stats.forms[FORM_NAMES[form]] = stats.forms.get(FORM_NAMES[form], 0) + 1
            stats.sent_bytes += HEADER_BYTES + payload.numel()
            stats.dense_bytes += n
        for o in rnd.outgoing:  # after every encode of the round read the old baselines
            if o.key in self.baselines:
                self.baselines[o.key].copy_(o.span)
        return sends

    def _receive_plan(self, k: int, rnd: _Round, headers, versions):
        """Where each payload lands: a DENSE one in its span, a delta in scratch (then
        re-pack + patch)."""
        recvs, patches, at = [], [], 0
        for incoming, raw in zip(rnd.incoming, headers):
            header = Header.read(raw)
            n = incoming.span.numel()
            if header.form == DENSE:
                if header.nbytes != n:
                    raise DeltaError(
                        f"refit rank {self.rank}: round {k}: rank {incoming.peer} sends a "
                        f"{header.nbytes}-byte dense message where the plan has {n}; the two "
                        "ranks compiled different plans"
                    )
                recvs.append((incoming.peer, incoming.span))
                continue
            mine = versions[self.rank]
            if incoming.repack is None or header.base != mine or header.nbytes > n:
                raise DeltaError(
                    f"refit rank {self.rank}: round {k}: rank {incoming.peer} sent a delta "
                    f"against version {header.base}, this rank holds version {mine}"
                    + ("" if incoming.repack is not None else " and cannot re-pack it")
                    + "; the group disagrees on versions (a bug: report it)"
                )
            payload = self._received[at : at + header.nbytes]
            at += header.nbytes
            recvs.append((incoming.peer, payload))
            patches.append((incoming, header, payload))
        return recvs, patches


def _unit(message) -> int:
    return unit_of([TORCH_DTYPES[t.dtype].itemsize for t in message.transfers])
