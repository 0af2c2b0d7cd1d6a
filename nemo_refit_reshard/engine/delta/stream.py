"""A delta round on CPU ranks: each incoming message applied as soon as it arrives.

The batched round (``DeltaProgram.replay``) waits for every header, then for every
payload, then applies them all. Here a rank posts a receive for each header, sends its
own headers and payloads at once (per peer: header, then payload, the order every
receiver expects), then takes its incoming messages one by one: header, payload receive,
apply — so it applies the first messages while the later ones are still on the wire.
The same messages travel in the same order per pair; only the waiting differs. Used on
CPU ranks (gloo), where every send and receive is its own request; a GPU round stays
batched (CuPy NCCL serializes groups on one stream).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..program import CopyPhase
from ..transport import Transport
from .codec import HEADER_BYTES
from .rounds import Incoming

# where one payload lands, given its header and the next free scratch byte
# (DeltaProgram.land, its round and version bound): (buffer, patch, next free byte)
Land = Callable[[Incoming, torch.Tensor, int], tuple[torch.Tensor, tuple, int]]


def stream_round(
    transport: Transport,
    k: int,
    phase: CopyPhase,
    sends: list[tuple[int, torch.Tensor, torch.Tensor]],
    incoming: list[Incoming],
    land: Land,
    apply: Callable[[tuple], None],
) -> None:
    """Round ``k``: ``sends`` (``encode_round``'s), then each of ``incoming`` received,
    landed (``land``) and applied (``apply``: ``DeltaProgram.apply``) in turn."""
    headers = [torch.empty(HEADER_BYTES, dtype=torch.uint8) for _ in incoming]
    arriving = [transport.start_exchange([], [(i.peer, h)], k) for i, h in zip(incoming, headers)]
    out = [(peer, h) for peer, h, _ in sends] + [(peer, p) for peer, _, p in sends if p.numel()]
    sent = transport.start_exchange(out, [], k)
    landing, at = [], 0
    for message, raw, header_arrived in zip(incoming, headers, arriving):
        header_arrived.wait()
        buf, patch, at = land(message, raw, at)
        recv = [(message.peer, buf)] if buf.numel() else []
        landing.append((transport.start_exchange([], recv, k), patch))
    for job in phase.before_in:
        job()
    for arrived, patch in landing:
        arrived.wait()
        apply(patch)
    for job in phase.after_in:
        job()
    sent.wait()
