"""Never serve torn weights (``integrations/weights.py``).

A sender killed in the middle of a refit leaves the receiver with some tensors of the
new step and some of the old: it must mark its weights stale and refuse to generate,
naming the failed step, until a later refit — here through a new refit group with a
restarted sender — succeeds and restores bit-exact weights.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from nemo_refit_reshard.engine.materialize import empty_like_layout, materialize, mismatches
from nemo_refit_reshard.engine.rendezvous import free_port, new_secret
from nemo_refit_reshard.integrations.worker import (
    RefitEndpoint,
    RefitWorker,
    StaleWeightsError,
    WeightsState,
)
from nemo_refit_reshard.plan import rank_plan
from tests.helpers.one_to_one import DEST, PLAN, SOURCE, canonical


def _die_after_rounds(transport: Any, rounds: int) -> None:
    """Fault injection: the process exits when it starts exchange ``rounds + 1``."""
    start, started = transport.start_exchange, [0]

    def start_then_die(sends, recvs, *round_index):
        if started[0] == rounds:
            os._exit(3)
        started[0] += 1
        return start(sends, recvs, *round_index)

    transport.start_exchange = start_then_die


def _sender(endpoint_json: str, steps: list[int], die_in_step: int | None) -> None:
    worker = RefitWorker(RefitEndpoint.from_json(endpoint_json), materialize(SOURCE, canonical(0)))
    worker.join()
    worker.load_plan(rank_plan(PLAN, 0).to_json())
    for step in steps:
        for name, t in materialize(SOURCE, canonical(step)).items():
            worker.tensors[name].copy_(t)  # the training step's new weights, in place
        if step == die_in_step:
            assert worker.transport is not None
            _die_after_rounds(worker.transport, 2)  # the receiver is then half updated
        worker.refit(step)
    worker.close()


def _receiver(first: str, second: str, out: str) -> None:
    report: dict[str, Any] = {}
    tensors = empty_like_layout(DEST)
    pointers = {n: t.data_ptr() for n, t in tensors.items()}
    worker = RefitWorker(RefitEndpoint.from_json(first), tensors)
    worker.join()
    worker.load_plan(rank_plan(PLAN, 1).to_json())
    worker.refit(1)
    report["after_1"] = [worker.weights.as_dict(), mismatches(DEST, tensors, canonical(1))]
    try:
        worker.refit(2)
        report["step_2"] = "completed"
    except Exception as err:  # noqa: BLE001 - the sender died: expected
        report["step_2"] = f"{type(err).__name__}"
    report["torn"] = [
        len(mismatches(DEST, tensors, canonical(1))),
        len(mismatches(DEST, tensors, canonical(2))),
        len(DEST.tensors),
    ]
    try:
        worker.weights.require_fresh("generation on vLLM rank 0")
        report["refused"] = None
    except StaleWeightsError as err:
        report["refused"] = str(err)
    worker.rejoin(RefitEndpoint.from_json(second))  # a restarted sender, a new group
    report["stale_after_rejoin"] = worker.weights.stale is not None
    worker.refit(3)
    report["after_3"] = [worker.weights.as_dict(), mismatches(DEST, tensors, canonical(3))]
    report["pointers_kept"] = all(t.data_ptr() == pointers[n] for n, t in tensors.items())
    worker.close()
    Path(out).write_text(json.dumps(report))


@pytest.mark.slow
def test_a_sender_killed_mid_refit_leaves_stale_weights_until_the_next_refit() -> None:
    def endpoint(rank: int, port: int, secret: str) -> str:
        return RefitEndpoint(
            "127.0.0.1", port, 2, rank, timeout_s=30, connect_timeout_s=300, secret=secret
        ).to_json()

    ctx = mp.get_context("spawn")
    first, second = (free_port(), new_secret()), (free_port(), new_secret())
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "receiver.json")
        receiver = ctx.Process(
            target=_receiver, args=(endpoint(1, *first), endpoint(1, *second), out)
        )
        sender = ctx.Process(target=_sender, args=(endpoint(0, *first), [1, 2], 2))
        receiver.start()
        sender.start()
        sender.join(600)
        assert sender.exitcode == 3  # died in step 2, as staged
        restarted = ctx.Process(target=_sender, args=(endpoint(0, *second), [3], None))
        restarted.start()
        restarted.join(600)
        receiver.join(600)
        assert (restarted.exitcode, receiver.exitcode) == (0, 0)
        report = json.loads(Path(out).read_text())
    fingerprint = PLAN.fingerprint
    assert report["after_1"] == [{"step": 1, "fingerprint": fingerprint, "stale": None}, []]
    assert report["step_2"] == "TransportError"
    old, new, total = report["torn"]
    assert 0 < old < total and 0 < new < total  # a mix of steps 1 and 2: torn
    assert report["refused"].startswith(
        "generation on vLLM rank 0 refused: the weights may be torn: the refit of step 2 "
        "failed (TransportError: refit rank 1: "
    ), report["refused"]
    assert report["refused"].endswith("; a later refit must succeed first")
    assert report["stale_after_rejoin"] is True
    assert report["after_3"] == [{"step": 3, "fingerprint": fingerprint, "stale": None}, []]
    assert report["pointers_kept"] is True


def test_weights_state_versions() -> None:
    w = WeightsState()
    w.require_fresh()  # the initial weights are whole
    w.begin(4, "abcdef0123456789")
    with pytest.raises(StaleWeightsError) as err:
        w.require_fresh("generation on replica 0")
    assert str(err.value) == (
        "generation on replica 0 refused: the weights may be torn: the refit of step 4 "
        "(plan abcdef012345) did not finish; a later refit must succeed first"
    )
    w.done(4, "abcdef0123456789")
    assert w.as_dict() == {"step": 4, "fingerprint": "abcdef0123456789", "stale": None}


def test_grpo_generation_actor_refuses_stale_weights() -> None:
    """The GRPO example's generation actor asks before sampling."""
    from types import SimpleNamespace

    from nemo_refit_reshard.grpo_cpu.actors import GenerationActor
    from nemo_refit_reshard.grpo_cpu.task import policy_config

    actor = GenerationActor()
    actor.setup(policy_config(), 0, 0, "tp=1", "float32", 0, 60.0)
    prompts = torch.zeros(1, 2, dtype=torch.long)
    actor.worker = SimpleNamespace(weights=WeightsState())  # type: ignore[assignment]
    assert actor.generate(prompts, 2, 1.0, 0) is not None  # whole weights: samples
    actor.worker.weights.begin(7, "0123456789abcdef")
    actor.group_rank = 5
    with pytest.raises(StaleWeightsError) as err:
        actor.generate(prompts, 2, 1.0, 0)
    assert str(err.value).startswith(
        "generation on refit rank 5 refused: the weights may be torn: the refit of step 7"
    )
