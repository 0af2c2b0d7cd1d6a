"""GlooTransport.all_gather_object_str: one collective when every value fits its first
56 bytes, a second for the rest of longer ones; every rank gets every value exactly."""

from __future__ import annotations

import pytest

from nemo_refit_reshard.engine.rendezvous import new_rendezvous
from nemo_refit_reshard.engine.transport import GlooTransport
from tests.helpers.delta_threads import on_threads

CASES = {
    "short": ["", "v7", "-2"],
    "at the edge": ["a" * 56, "b" * 55, "c" * 57],
    "long and wide": ["é" * 100, "", '{"fixed": [[0, 3, [[0, 64]]]]}' * 9],
}


@pytest.mark.parametrize("values", list(CASES.values()), ids=list(CASES))
def test_every_rank_gets_every_value_whatever_its_length(values: list[str]) -> None:
    meet = new_rendezvous()
    world = len(values)

    def gather(rank: int) -> list[list[str]]:
        transport = GlooTransport(meet.ip, meet.port, rank, world, timeout_s=60, secret=meet.secret)
        try:  # twice: a gather leaves nothing behind for the next
            return [transport.all_gather_object_str(values[rank]) for _ in range(2)]
        finally:
            transport.close()

    assert on_threads(world, gather) == [[values, values]] * world
