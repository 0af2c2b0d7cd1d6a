"""``reshard-colocated``: our colocated plan, each GPU's share compiled as the engine does.

``nemo_refit_reshard/engine/colocated.py``: per GPU, the training rank (the host) packs
its outgoing messages (``RankProgram`` ``copies_out``: one device copy per staged span,
identical messages to several peers packed once) — the one for its own worker straight
into that worker's staging (``outgoing_into``, as ``ColocatedHost`` compiles it), the
others into its send buffer — sends the latter, receives the rest of its worker's
messages into the staging; the worker unpacks everything into its parameters
(``copies_in``). Both programs are compiled here on the meta device, with the code the
engine runs, so the copies and buffer sizes are the engine's own (serial replay: one
send buffer, one staging, each sized to the largest round: ``engine/program.py``).
"""

from __future__ import annotations

import torch

from benchmarks.colocated.common import Case, Figures
from nemo_refit_reshard.engine.program import TORCH_DTYPES, RankProgram


def _program(case: Case, group_rank: int, into: dict | None = None) -> RankProgram:
    """One refit-group rank's compiled share, bound to meta tensors of its layout
    (``into``: its own worker's staging spans, as ``ColocatedHost`` passes them)."""
    tensors = {
        name: torch.empty(shape, dtype=TORCH_DTYPES[dtype], device="meta")
        for name, (shape, dtype) in case.plan.expected_tensors(group_rank).items()
    }
    return RankProgram(case.plan, group_rank, tensors, "meta", outgoing_into=into)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def gpu_shares(case: Case) -> list[dict[str, int]]:
    """Per GPU ``g`` (training rank ``g``, inference rank ``g``): ``net_in`` (bytes its
    worker receives over the interconnect), ``pack`` / ``move`` / ``unpack`` (device
    copies: the host's packing, any copy of its own bytes from its send buffer into the
    staging — none: they are packed there —, the worker's unpacking), ``local`` (plan
    bytes that never leave the GPU), ``send_buffer`` and ``staging`` (bytes of the two
    buffers)."""
    plan, s = case.plan, case.num_gpus
    hosts = plan.colocated_hosts
    net_in = [0] * s
    local = [0] * s
    for messages in plan.traffic():
        for src, dst, nbytes in messages:
            host = hosts[dst - s]
            if src == host:
                local[host] += nbytes
            else:
                net_in[host] += nbytes
    shares = []
    guest_of = {h: d for d, h in enumerate(hosts)}
    for g in range(s):
        guest = _program(case, s + guest_of[g]) if g in guest_of else None
        into = {
            (k, s + guest_of[g]): span
            for k, phase in enumerate(guest.rounds if guest is not None else [])
            for peer, span in phase.recvs
            if peer == g
        }
        own = _program(case, g, into)
        pack = sum(
            _nbytes(staged)
            for phase in own.rounds
            for staged, _ in [*phase.copies_out, *phase.local_out]
        )
        move = sum(
            _nbytes(buf)
            for phase in own.rounds
            for peer, buf in phase.sends
            if hosts[peer - s] == g
        )
        unpack = staging = 0
        if guest is not None:
            unpack = sum(_nbytes(staged) for ph in guest.rounds for _, staged in ph.copies_in)
            staging = guest.recv_buffers[0].numel()
        shares.append(
            dict(
                net_in=net_in[g], pack=pack, move=move, unpack=unpack, local=local[g],
                send_buffer=own.send_buffers[0].numel() + own.relay_buffer.numel(),
                staging=staging,
            )
        )  # fmt: skip
    return shares


def ours_figures(case: Case) -> Figures:
    """Interconnect: the plan's bytes between different GPUs (``plan.colocated_bytes()``);
    copies: pack + move + unpack; nothing materialized; extra memory: the host's send
    buffer plus its worker's staging (``ColocatedHost.staging_bytes``)."""
    shares = gpu_shares(case)
    split = case.plan.colocated_bytes()
    assert split.network == sum(g["net_in"] for g in shares)
    copied = [g["pack"] + g["move"] + g["unpack"] for g in shares]
    extra = [g["send_buffer"] + g["staging"] for g in shares]
    return Figures(
        net_total=split.network,
        net_max=max(g["net_in"] for g in shares),
        copied_max=max(copied),
        materialized_max=0,
        extra_max=max(extra),
        notes=[f"{split.local / 2**30:,.2f} GiB device-local in all"],
    )
