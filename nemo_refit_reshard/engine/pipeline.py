"""Overlapped replay: round k+1 is packed while round k is on the wire, and round k is
unpacked while round k+1 is.

Per rank, with rounds ``0..n-1`` compiled onto two staging buffer sets (round ``k``
uses set ``k mod 2``), the host issues::

    pack(0); start(0)
    for k in 0..n-1:
        pack(k+1)           # overlaps wire k (set (k+1) mod 2 was last sent in round k-1,
                            #   which wait(k-1) finished)
        wait(k)             # the timeout lives here: a dead peer raises within timeout_s
        start(k+1)          # receives into set (k+1) mod 2, last unpacked in round k-1
        unpack(k)           # overlaps wire k+1

One exchange is in flight at a time, so messages between two ranks never overtake each
other; each exchange still names its round (``start_exchange(..., round_index=k)``), so
that a transport tags it with the step and the round (``engine/transport.py``). A
round whose pack reads what the previous round's unpack writes — bytes carried in the
relay buffer (``plan/pass4_routes/carry.py``) or relayed on from the rank's own tensors
along an inference chain (``plan/pass4_routes/chain.py``) — waits for that unpack:
``wait(k); unpack(k); pack(k+1); start(k+1)``.

Staging memory is two sets instead of one: at most ``2 x bucket`` per direction (the
planner keeps what a rank sends, and what it receives, in one round within the bucket;
messages start 16-byte aligned), plus the relay buffer, which already alternates halves.

On CUDA the packs and unpacks are queued on torch's current stream and the transport
orders its NCCL stream after them with CUDA events (``CupyNcclTransport.start_exchange``);
the host only polls for completion, to enforce the timeout. On CPU the same order
overlaps the host's copies with gloo's background sends and receives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .transport import Transport


class Phase(Protocol):
    """What the pipeline needs of a compiled round (``program.CopyPhase``)."""

    sends: list
    recvs: list
    reads_previous: bool

    def pack(self) -> None: ...

    def unpack(self) -> None: ...


class _Done:
    def wait(self) -> None:
        pass


def _start(phase: Phase, transport: Transport, round_index: int):
    if not (phase.sends or phase.recvs):
        return _Done()
    return transport.start_exchange(phase.sends, phase.recvs, round_index)


def replay_overlapped(phases: Sequence[Phase], transport: Transport) -> None:
    """One refit step over ``phases`` (compiled on alternating staging sets), overlapped
    as the module docstring shows. Any transport error propagates from ``wait``."""
    n = len(phases)
    if n == 0:
        return
    phases[0].pack()
    pending = _start(phases[0], transport, 0)
    for k in range(n):
        nxt = phases[k + 1] if k + 1 < n else None
        early = nxt is not None and not nxt.reads_previous
        if early:
            nxt.pack()
        pending.wait()
        if nxt is None:
            phases[k].unpack()
        elif early:
            pending = _start(nxt, transport, k + 1)
            phases[k].unpack()
        else:  # nxt sends bytes that round k delivers into the relay buffer
            phases[k].unpack()
            nxt.pack()
            pending = _start(nxt, transport, k + 1)


def replay_serial(phases: Sequence[Phase], transport: Transport) -> None:
    """Round by round: pack, exchange, unpack (one staging set is enough)."""
    for k, phase in enumerate(phases):
        phase.pack()
        _start(phase, transport, k).wait()
        phase.unpack()
