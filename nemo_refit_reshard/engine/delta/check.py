"""Each delta's base checked against what its receiver holds, every step.

A receiver keeps no baseline: its live tensors are its implicit one, and only a version
number says what they hold. Anything that changes them outside the refit — vLLM's
``sleep(level=2)`` and ``reload_weights`` on the vLLM-native route (which installs no
``watch_weights``), a user's ``load_weights``, a sender's ``prime()`` after the trainer's
optimizer step (its baselines then hold a newer version than the receivers) — would make
every later delta patch the wrong bytes: permanent, silent corruption. So before a
step's first round, every receiver sends each of its senders a *fingerprint* of each
message as its live tensors hold it now, and the sender compares it with the
fingerprint of the baseline its delta would be taken against: a message whose two
fingerprints differ goes dense this step (its receiver is whole again after it).

Fingerprint of a message's bytes, as ``u``-byte signed integers ``b_i`` (``u`` its
unit), leaving out its *fixed* byte ranges (they travel whole every step)::

    F = (Σ b_i, Σ b_i²)   (int64, wrapping)

Sums, so a receiver takes them over its live runs where they live (no pack) and a
sender over its baseline less the fixed ranges; two of them, so that a change whose
sum cancels (a +1 and a -1) still shows in the squares. What they cannot see: units
moved within a message with their values kept (two equal-sized tensors swapped, a
re-layout in place) — values changed, not moved, are what weights changed outside the
refit bring. Cost per step: one read of
each receiver's delta-receiving weights and of each sender's baselines (on a GPU, at
HBM speed), and one small exchange (16 bytes a message) — measured in
``docs/benchmarks.md``. ``DeltaOptions(check=False)`` turns it off.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np
import torch

from ..transport import Transport
from .rounds import FIXED, Incoming, Outgoing, Round


class DeltaRank(Protocol):
    """What the check reads of a rank's ``DeltaProgram`` (``engine/delta/program.py``), which
    imports this module."""

    device: torch.device
    rounds: list[Round]
    baselines: dict[int, torch.Tensor]
    fixed_out: dict[tuple[int, int], tuple[tuple[int, int], ...]]
    base_fingerprints: dict[tuple[int, int], torch.Tensor]


FINGERPRINT_BYTES = 16
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22  # elements per pass: bounds the int64 temporary of the squares


def unit_sums(t: torch.Tensor, unit: int) -> torch.Tensor:
    """``(Σ b, Σ b²)`` (int64, on ``t``'s device) of ``t``'s bytes read as ``unit``-byte
    signed integers (``unit`` divides its itemsize: a message's unit is its smallest)."""
    if t.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    if t.dim() == 0 or t.stride(-1) != 1:
        t = t.contiguous()  # (a view of a dtype needs its last dimension dense)
    ints = t.view(_INTS[unit])
    if ints.device.type == "cpu":
        # numpy reduces a strided view in int64 without a temporary (5x torch's passes);
        # sums wrap modulo 2**64 in both, whatever the order
        a = ints.numpy()
        s1 = np.add.reduce(a, axis=None, dtype=np.int64)
        axes = "ijklmn"[: a.ndim]
        s2 = np.einsum(f"{axes},{axes}->", a, a, dtype=np.int64)
        return torch.tensor([int(s1), int(s2)], dtype=torch.int64)
    # Chunks of at most _CHUNK elements bound the int64 temporaries: a dense view's flat
    # elements, or a strided view's rows (a row longer than a chunk goes whole).
    if ints.is_contiguous():
        chunks = ints.reshape(-1).split(_CHUNK)
    else:
        rows = ints.reshape(-1, ints.shape[-1])
        chunks = rows.split(max(1, _CHUNK // rows.shape[1]))
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    for chunk in chunks:
        wide = chunk.to(torch.int64)
        out[0] += wide.sum()
        out[1] += (wide * wide).sum()
    return out


def incoming_fingerprint(message: Incoming) -> torch.Tensor:
    """What ``message``'s receiver holds of it now: the sums over its live runs, its
    fixed runs left out."""
    total = torch.zeros(2, dtype=torch.int64, device=message.span.device)
    for run in message.runs:
        if run.mode != FIXED:
            total += unit_sums(run.live, message.unit)
    return total


def baseline_fingerprint(
    baseline: torch.Tensor, unit: int, fixed: Iterable[tuple[int, int]]
) -> torch.Tensor:
    """The sums of a baseline (a message's bytes), its ``fixed`` byte ranges left out."""
    total = unit_sums(baseline, unit)
    for a, b in fixed:
        total -= unit_sums(baseline[a:b], unit)
    return total


def pairs_in_order(rounds: Sequence[Round], outgoing: bool) -> dict[int, list[tuple[int, int]]]:
    """Per peer, ``(round, index in the round's list)`` of every message exchanged with
    it, in round order: the order both ends of a pair list their fingerprints in (the
    order the pair's messages of a round are issued in, which the transport pairs by)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for k, rnd in enumerate(rounds):
        messages: list[Incoming] | list[Outgoing] = rnd.outgoing if outgoing else rnd.incoming
        for i, m in enumerate(messages):
            out.setdefault(m.peer, []).append((k, i))
    return out


def baseline_fingerprints(program: DeltaRank) -> dict[tuple[int, int], torch.Tensor]:
    """``(round, index among the round's outgoing messages)`` -> the fingerprint of the
    baseline a delta of that message is taken against (after a step, or a prime: the
    baselines hold the messages sent)."""
    out: dict[tuple[int, int], torch.Tensor] = {}
    for k in range(len(program.rounds)):
        out.update(round_fingerprints(program, k, staged=False))
    return out


def round_fingerprints(
    program: DeltaRank, k: int, staged: bool
) -> dict[tuple[int, int], torch.Tensor]:
    """The fingerprints of round ``k``'s outgoing messages that have baselines, taken
    from their staging spans (``staged``: right after the round's encode, where they
    hold what the baselines now hold, on the rank's device — a host baseline is never
    read) or from the baselines themselves."""
    out: dict[tuple[int, int], torch.Tensor] = {}
    for i, o in enumerate(program.rounds[k].outgoing):
        if o.key in program.baselines:
            fixed = program.fixed_out.get((o.peer, k), ())
            whole = o.span if staged else program.baselines[o.key]
            out[(k, i)] = baseline_fingerprint(whole, o.unit, fixed)
    return out


def exchange_fingerprints(
    program: DeltaRank, transport: Transport, versions: Sequence[int], mine: int
) -> tuple[set[tuple[int, int]], int]:
    """Before a step's first round (not a dense one): every rank sends each sender the
    fingerprints of the messages it receives from it, as its live tensors hold them
    now (zeros where it holds no version: it gets dense messages anyway), and receives
    its receivers'. The ``(round, index)`` of each outgoing message whose receiver holds
    other bytes than the baseline the delta would be taken against: it goes dense; and
    the bytes of fingerprints this rank sent."""
    device = program.device
    incoming = pairs_in_order(program.rounds, outgoing=False)
    outgoing = pairs_in_order(program.rounds, outgoing=True)
    zero = torch.zeros(2, dtype=torch.int64, device=device)
    sends = []
    for peer, at in incoming.items():
        held = versions[peer] == mine >= 0
        prints = [
            incoming_fingerprint(program.rounds[k].incoming[i]) if held else zero for k, i in at
        ]
        sends.append((peer, as_bytes(prints, device)))
    recvs = [
        (peer, torch.empty(FINGERPRINT_BYTES * len(at), dtype=torch.uint8, device=device))
        for peer, at in outgoing.items()
    ]
    # A round index of its own (past the plan's last): on gloo its messages carry their
    # own tag, and a failure here is not reported as round 0's.
    transport.exchange(sends, recvs, len(program.rounds))
    expected = program.base_fingerprints
    keys, got, want = [], [], []
    for peer, buf in recvs:
        if mine < 0 or versions[peer] != mine:
            continue  # dense to it anyway
        rows = [(n, key) for n, key in enumerate(outgoing[peer]) if key in expected]
        if rows:
            keys += [key for _, key in rows]
            got.append(buf.view(torch.int64).view(-1, 2)[[n for n, _ in rows]])
            # (a host baseline's fingerprint is on the CPU, the received ones on the device)
            want += [expected[key].to(device) for _, key in rows]
    if not keys:
        return set(), sum(buf.numel() for _, buf in sends)
    differs = (torch.cat(got) != torch.stack(want)).any(dim=1).tolist()  # the step's one sync
    stale = {key for key, bad in zip(keys, differs) if bad}
    return stale, sum(buf.numel() for _, buf in sends)


def as_bytes(fingerprints: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Fingerprints back to back, as the bytes one message carries."""
    if not fingerprints:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.stack(fingerprints).reshape(-1).view(torch.uint8)


__all__ = [
    "FINGERPRINT_BYTES",
    "as_bytes",
    "baseline_fingerprint",
    "baseline_fingerprints",
    "round_fingerprints",
    "exchange_fingerprints",
    "incoming_fingerprint",
    "pairs_in_order",
    "unit_sums",
]
