"""What a delta refit (``engine/delta/program.py``) holds per refit-group rank beyond the dense
refit's staging (``plan/result/memory.py``), from the plan alone.

A rank's ``DeltaProgram`` allocates, once:

* **baselines**: a copy of each distinct outgoing message that can travel as a delta
  (:func:`~.delta.baseline_memory`): on the rank's device by default; in pinned host
  memory with ``DeltaOptions(baseline="host")``, and always for an inference rank that
  forwards along a chain (no second copy of the model on an inference GPU). A DeepSeek-V3
  training rank in BF16 keeps ~5.5 GiB of them: where its GPU cannot, ``"host"``.
* **scratch**, on the device: the encoded payloads of a round (one send staging's
  bytes) and the received ones (one receive staging's), whatever the baselines' place.
* **held** (a colocated host, ``engine/delta/colocated.py``): in host memory, the last
  content of each message its guest receives from the other hosts; the host's scratch
  then also receives its guest's payloads (one guest receive staging). The guest's own
  process adds nothing.

``plan --json --delta`` reports both per rank, and the peak extra bytes of a rank's
device include the device-resident ones (``tests/test_delta_memory.py`` compiles every
rank and compares).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..result.memory import staging_sizes
from ..result.refit_plan import RefitPlan
from .delta import baseline_memory

# The places a plan can report; the engine's default "auto" picks one of them at run
# time, from the GPU's free memory (engine/delta/options.choose_baseline_place).
PLANNED_PLACES = ("device", "host")


@dataclass(frozen=True)
class DeltaMemory:
    """One rank's delta refit memory: ``baselines`` and ``scratch`` on its device,
    ``host_baselines`` in (pinned) host memory."""

    baselines: int
    host_baselines: int
    scratch: int
    held: int = 0  # host memory: a colocated host's copies of its guest's messages

    @property
    def device_bytes(self) -> int:
        return self.baselines + self.scratch

    def to_json(self) -> dict[str, int]:
        """The device total, then every field under its own name."""
        return {"device_bytes": self.device_bytes, **asdict(self)}


def delta_memory(plan: RefitPlan, baseline: str = "device") -> list[DeltaMemory]:
    """Per refit-group rank, what its ``DeltaProgram`` allocates with baselines kept at
    ``baseline`` (``"device"`` or ``"host"``); a colocated plan's, as its hosts'
    ``ColocatedDelta`` allocate it."""
    if baseline not in PLANNED_PLACES:
        raise ValueError(f"delta baseline={baseline!r}: choose one of {list(PLANNED_PLACES)}")
    world = plan.num_sources + plan.num_destinations
    if plan.colocated_hosts:
        return [_colocated(plan, r, baseline) for r in range(world)]
    kept = baseline_memory(plan)
    out = []
    for rank, nbytes in enumerate(kept):
        sizes = staging_sizes(plan.messages_of(rank), rank, plan.num_rounds)
        on_host = baseline == "host" or rank >= plan.num_sources
        out.append(
            DeltaMemory(
                baselines=0 if on_host else nbytes,
                host_baselines=nbytes if on_host else 0,
                scratch=sizes.send + sizes.recv,
            )
        )
    return out


def _colocated(plan: RefitPlan, rank: int, baseline: str) -> DeltaMemory:
    """Training rank ``rank`` of a colocated plan: baselines of its distinct messages to
    the other hosts' guests (nothing of them fixed: every receiver holds its copy), the
    scratch of its own program and of its guest's receiving half, and the copies it
    holds of its guest's messages from the other hosts. A guest: nothing."""
    s = plan.num_sources
    if rank >= s:
        return DeltaMemory(0, 0, 0)
    hosts = plan.colocated_hosts
    guest = s + hosts.index(rank) if rank in hosts else None
    sent = [m for m in plan.messages_of(rank) if m.dst != guest]  # its guest's: no wire
    own = staging_sizes(sent, rank, plan.num_rounds)
    distinct = {
        (m.round, tuple((t.src_tensor, t.src_box, t.dtype) for t in m.transfers)): m
        for m in sent
        if m.src == rank
    }
    kept = sum(sum(t.nbytes for t in m.transfers) for m in distinct.values())
    scratch, held = own.send + own.recv, 0
    if guest is not None:
        received = plan.messages_of(guest)
        half = staging_sizes(received, guest, plan.num_rounds)
        scratch += half.send + half.recv
        held = sum(
            sum(t.nbytes for t in m.transfers) for m in received if m.dst == guest and m.src != rank
        )
    on_host = baseline == "host"
    return DeltaMemory(0 if on_host else kept, kept if on_host else 0, scratch, held)


def delta_memory_report(plan: RefitPlan, memory: dict, baseline: str = "device") -> dict:
    """``plan --json``'s ``memory`` with the delta refit's bytes added (``--delta``): per
    rank its delta figures under ``ranks[i]["delta"]``, ``peak_extra_bytes`` and its
    maximum including the device-resident ones, and the largest host baselines."""
    ranks = delta_memory(plan, baseline)
    peaks = [p + d.device_bytes for p, d in zip(memory["peak_extra_bytes"], ranks)]
    return {
        **memory,
        "delta_baseline": baseline,
        "peak_extra_bytes": peaks,
        "max_peak_extra_bytes": max(peaks, default=0),
        "max_delta_host_bytes": max((d.host_baselines + d.held for d in ranks), default=0),
        "ranks": [{**r, "delta": d.to_json()} for r, d in zip(memory["ranks"], ranks)],
    }


__all__ = ["PLANNED_PLACES", "DeltaMemory", "delta_memory", "delta_memory_report"]
