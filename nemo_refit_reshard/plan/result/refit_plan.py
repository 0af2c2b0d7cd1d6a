"""The refit plan as built: messages per round, stats, fingerprint, JSON round trip.

Sources are refit-group ranks ``0..S-1``; destination ``d`` is refit-group rank
``S + d``; transfers and messages name refit-group ranks. ``build.py`` builds it
(``plan_refit``), ``pass7_assemble.py`` assembles it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ...layouts.base import Box
from ..base import PlanError
from ..colocation import ColocatedBytes, colocated_bytes
from ..pass6_messages import Message
from .expand import Expansion
from .fp8_steps import QuantizeStep
from .serialize import NameTable, compact_json, fingerprint_of, message_from_json, rounds_text

if TYPE_CHECKING:
    from ..relay_choice import RelayChoice

PLAN_VERSION = 2


@dataclass(frozen=True)
class PlanStats:
    bytes_sent: tuple[int, ...]  # per refit-group rank (sources, then destinations)
    bytes_received: tuple[int, ...]  # per refit-group rank
    total_bytes: int
    min_bytes: int  # sum of destination needs: the floor any refit must move
    baseline_bytes: int  # gather to one training rank + broadcast to every inference rank
    num_transfers: int
    num_messages: int
    num_rounds: int
    # Block-FP8 plans: bytes sent per dtype (e4m3, float32 scales, trained-dtype shadows).
    bytes_by_dtype: tuple[tuple[str, int], ...] = ()

    def to_json(self) -> dict[str, Any]:
        extra = {"bytes_by_dtype": dict(self.bytes_by_dtype)} if self.bytes_by_dtype else {}
        return {
            "bytes_sent": list(self.bytes_sent),
            "bytes_received": list(self.bytes_received),
            "total_bytes": self.total_bytes,
            "min_bytes": self.min_bytes,
            "baseline_bytes": self.baseline_bytes,
            "num_transfers": self.num_transfers,
            "num_messages": self.num_messages,
            "num_rounds": self.num_rounds,
            **extra,
        }


TensorTable = tuple[dict[str, tuple[tuple[int, ...], str]], ...]


@dataclass(frozen=True)
class RefitPlan:
    """A deterministic transfer plan; ``fingerprint`` identifies its content.

    Inference replicas hold identical layouts, so they receive identical
    messages from the same senders in the same rounds. The plan stores them
    once: ``class_rounds`` names only the first rank of each replica group in
    ``replica_groups`` (``(first, *others)``; destinations in no group stand
    for themselves), and :attr:`rounds` / :meth:`messages_of` expand them.
    A sender sends each such message once per member.
    """

    model: str
    num_sources: int
    num_destinations: int
    bucket_bytes: int
    source_tensors: TensorTable  # per source rank: local name -> (shape, dtype) it sends from
    destination_tensors: TensorTable  # per destination rank: name -> (shape, dtype)
    class_rounds: tuple[tuple[Message, ...], ...]
    stats: PlanStats
    replica_groups: tuple[tuple[int, ...], ...] = ()  # refit-group ranks, first = stored one
    relay_chains: tuple[tuple[int, ...], ...] = ()  # (entry, next, ...): forwarding order
    # Colocated refit (plan/colocation.py): the source rank on each destination's GPU.
    colocated_hosts: tuple[int, ...] = ()
    # How ``relay="auto"`` picked the relay mode (``relay_choice.py``); not part of the
    # plan's content, so not in its JSON or fingerprint.
    relay_choice: RelayChoice | None = field(default=None, compare=False, repr=False)
    # Block-FP8 refits (layouts/fp8_wire.py): the block, and per refit-group rank the
    # quantization it runs before (sources) or after (destinations) each step.
    fp8_block: tuple[int, int] | None = None
    quantize_steps: tuple[tuple[QuantizeStep, ...], ...] = ()

    @property
    def num_rounds(self) -> int:
        return self._expansion.num_rounds

    @cached_property
    def _expansion(self) -> Expansion:
        return Expansion(self.class_rounds, self.replica_groups, self.relay_chains)

    @cached_property
    def rounds(self) -> tuple[tuple[Message, ...], ...]:
        """Every message of every rank, replica groups and relay runs expanded (for
        small plans; workers use :meth:`messages_of`)."""
        return tuple(tuple(msgs) for msgs in self._expansion.all_messages())

    def traffic(self) -> list[list[tuple[int, int, int]]]:
        """Per round, ``(src, dst, bytes)`` of every message, expanded like :attr:`rounds`
        (computed once: the prediction and the timeline both read it; not to be changed)."""
        return self._traffic

    @cached_property
    def _traffic(self) -> list[list[tuple[int, int, int]]]:
        return self._expansion.traffic()

    def expected_tensors(self, group_rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """The live tensors (name -> shape, dtype) this refit-group rank must hold."""
        if group_rank < self.num_sources:
            return self.source_tensors[group_rank]
        return self.destination_tensors[group_rank - self.num_sources]

    def messages_of(self, group_rank: int) -> list[Message]:
        """Every message this refit-group rank sends or receives, in round order."""
        return self._expansion.messages_of(group_rank)

    def quantize_steps_of(self, group_rank: int) -> tuple[QuantizeStep, ...]:
        """The block-FP8 quantization this refit-group rank runs (``fp8_steps.py``)."""
        return self.quantize_steps[group_rank] if self.quantize_steps else ()

    def colocated_bytes(self) -> ColocatedBytes:
        """A colocated plan's bytes, device-local and over the interconnect."""
        if not self.colocated_hosts:
            raise PlanError("not a colocated plan: every byte crosses the interconnect")
        return colocated_bytes(self.traffic(), self.colocated_hosts, self.num_sources)

    # -- serialization (JSON, no pickle) ----------------------------------------------
    def _body(self, rounds: Any, names: NameTable) -> dict[str, Any]:
        """The plan's JSON body, with ``rounds`` as given and the tensor names that
        ``names`` collected while they were written."""

        def tensors(table: TensorTable) -> list[dict[str, Any]]:
            return [
                {name: [list(shape), dtype] for name, (shape, dtype) in sorted(rank.items())}
                for rank in table
            ]

        body: dict[str, Any] = {
            "version": PLAN_VERSION,
            "model": self.model,
            "num_sources": self.num_sources,
            "num_destinations": self.num_destinations,
            "bucket_bytes": self.bucket_bytes,
            "source_tensors": tensors(self.source_tensors),
            "destination_tensors": tensors(self.destination_tensors),
            "replica_groups": [list(g) for g in self.replica_groups],
            "relay_chains": [list(c) for c in self.relay_chains],
            "names": names.names,
            "rounds": rounds,
            "stats": self.stats.to_json(),
        }
        if self.colocated_hosts:  # absent otherwise: separate-pool plans keep their bytes
            body["colocated_hosts"] = list(self.colocated_hosts)
        if self.fp8_block is not None:  # likewise
            body["fp8"] = {
                "block": list(self.fp8_block),
                "steps": [[q.to_json() for q in rank] for rank in self.quantize_steps],
            }
        return body

    @cached_property
    def _body_text(self) -> str:
        """``compact_json`` of the body, its rounds written by ``rounds_text`` (the same
        text as ``message_json`` rows would give, ``tests/test_plan_units.py``)."""
        names = NameTable()
        rounds = rounds_text(self.class_rounds, names)
        body = self._body(None, names)
        return (
            "{"
            + ",".join(
                f"{json.dumps(key)}:{rounds if key == 'rounds' else compact_json(value)}"
                for key, value in body.items()
            )
            + "}"
        )

    @cached_property
    def fingerprint(self) -> str:
        """16 hex digits of the SHA-256 of the plan's JSON body: computed on first use
        (serialising a DeepSeek-V3 plan takes seconds; building it need not wait)."""
        return fingerprint_of(self._body_text)

    def to_json(self) -> str:
        return self._body_text[:-1] + f',"fingerprint":"{self.fingerprint}"}}'

    @classmethod
    def from_json(cls, text: str) -> RefitPlan:
        data = json.loads(text)
        if data.get("version") != PLAN_VERSION:
            raise PlanError(
                f"plan version {data.get('version')} is not {PLAN_VERSION}; rebuild the plan "
                "with this version of nemo-refit-reshard"
            )

        def tensors(rows: list[dict[str, Any]]) -> TensorTable:
            return tuple(
                {name: (tuple(shape), dtype) for name, (shape, dtype) in rank.items()}
                for rank in rows
            )

        boxes: dict[tuple, Box] = {}
        rounds = tuple(
            tuple(message_from_json(r, m, data["names"], boxes) for m in msgs)
            for r, msgs in enumerate(data["rounds"])
        )
        s = data["stats"]
        fp8 = data.get("fp8")
        plan = cls(
            model=data["model"],
            num_sources=data["num_sources"],
            num_destinations=data["num_destinations"],
            bucket_bytes=data["bucket_bytes"],
            source_tensors=tensors(data["source_tensors"]),
            destination_tensors=tensors(data["destination_tensors"]),
            class_rounds=rounds,
            stats=PlanStats(
                bytes_sent=tuple(s["bytes_sent"]),
                bytes_received=tuple(s["bytes_received"]),
                bytes_by_dtype=tuple(sorted(s.get("bytes_by_dtype", {}).items())),
                **{
                    k: s[k]
                    for k in (
                        "total_bytes",
                        "min_bytes",
                        "baseline_bytes",
                        "num_transfers",
                        "num_messages",
                        "num_rounds",
                    )
                },
            ),
            replica_groups=tuple(tuple(g) for g in data["replica_groups"]),
            relay_chains=tuple(tuple(c) for c in data["relay_chains"]),
            colocated_hosts=tuple(data.get("colocated_hosts", ())),
            fp8_block=tuple(fp8["block"]) if fp8 else None,  # type: ignore[arg-type]
            quantize_steps=tuple(
                tuple(QuantizeStep.from_json(q) for q in rank) for rank in fp8["steps"]
            )
            if fp8
            else (),
        )
        if plan.fingerprint != data["fingerprint"]:
            raise PlanError(
                "plan file content does not match its fingerprint (corrupted or edited)"
            )
        return plan
