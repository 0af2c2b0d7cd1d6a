"""Where and as whom a worker joins the refit group: the endpoint the driver ships."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ...engine.delta import DeltaOptions
from ...engine.transport import DEFAULT_TIMEOUT_S

TRANSPORTS = ("gloo", "cupy-nccl")  # the refit group's transports (engine/)


@dataclass(frozen=True)
class RefitEndpoint:
    """Where and as whom a worker joins the refit group (JSON-serialisable)."""

    host: str  # refit rank 0's IP, where the group's store listens (the JSON key "host")
    port: int
    world_size: int
    group_rank: int  # training ranks 0..S-1, generation rank d is S + d
    transport: str = "gloo"
    timeout_s: float = DEFAULT_TIMEOUT_S  # every wait of a refit (a dead peer raises within)
    connect_timeout_s: float | None = None  # rendezvous; None: timeout_s. Set it from the
    # framework's start-up budget: processes join as they finish starting, and a loaded
    # machine starts them slowly.
    secret: str | None = field(default=None, repr=False)  # the run's (engine/rendezvous.py)
    # Delta refit (engine/delta/program.py) for every rank of the group; None: dense. It travels
    # with the endpoint so that every route turns it on the same way on every rank.
    delta: DeltaOptions | None = None

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"unknown refit transport {self.transport!r}; choose from {TRANSPORTS}"
            )
        if not 0 <= self.group_rank < self.world_size:
            raise ValueError(f"refit rank {self.group_rank} outside a group of {self.world_size}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RefitEndpoint:
        fields = json.loads(text)
        if fields.get("delta") is not None:
            fields["delta"] = DeltaOptions(**fields["delta"])
        return cls(**fields)
