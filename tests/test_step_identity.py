"""Step identity on the wire (issue 40, item 2) and the colocated host's own bytes (item 10).

A message or signal left over from a failed step ``n`` must never complete step ``n + 1``:
gloo tags every message with the group's step and round, colocated signals carry the
step's sequence and the round, and after any failed step the group (or host/worker pair)
refuses every later step, naming the failed one, until it is re-joined.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from nemo_refit_reshard.engine.colocated import ColocatedGuest, ColocatedHost, Signals
from nemo_refit_reshard.engine.materialize import empty_like_layout, materialize, mismatches
from nemo_refit_reshard.engine.rendezvous import free_port, new_secret
from nemo_refit_reshard.engine.transport import GlooTransport, TransportError
from nemo_refit_reshard.integrations.worker import (
    ColocatedTrainer,
    ColocatedWorker,
    RefitEndpoint,
    RefitWorker,
)
from nemo_refit_reshard.layouts import megatron_layout, vllm_layout
from nemo_refit_reshard.plan import Colocation, PlanError, plan_refit, rank_plan
from nemo_refit_reshard.spec import InferParallel, TrainParallel
from tests.helpers.one_to_one import DEST, PLAN, SOURCE, SPEC, canonical

COLOCATED = plan_refit(SPEC, [SOURCE], [DEST], bucket_mb=0.01, colocation=Colocation((0,)))


# -- gloo: a delayed message of a failed step ------------------------------------------------
def _fail_first_exchange(transport: Any) -> None:
    """Fault injection: the next exchange raises before it posts anything, so the peer's
    messages of this step stay in flight (delayed) when the step fails."""
    start = transport.start_exchange

    def fail_once(sends, recvs, *round_index):
        transport.start_exchange = start
        raise TransportError("injected: this rank lost its step")

    transport.start_exchange = fail_once


def _gloo_rank(rank: int, first: str, second: str, out: str) -> None:
    report: dict[str, Any] = {}
    tensors = materialize(SOURCE, canonical(0)) if rank == 0 else empty_like_layout(DEST)
    worker = RefitWorker(RefitEndpoint.from_json(first), tensors)
    worker.join()
    worker.load_plan(rank_plan(PLAN, rank).to_json())
    for step in (1, 2, 3):
        if rank == 0:
            for name, t in materialize(SOURCE, canonical(step)).items():
                worker.tensors[name].copy_(t)
        if rank == 1 and step == 2:
            _fail_first_exchange(worker.transport)
        try:
            worker.refit(step)
            report[str(step)] = "completed"
        except Exception as err:  # noqa: BLE001 - the texts are what the test checks
            report[str(step)] = f"{type(err).__name__}: {err}"
    if rank == 1:
        report["after_3"] = len(mismatches(DEST, tensors, canonical(3)))
    worker.rejoin(RefitEndpoint.from_json(second))  # a new group: the documented way back
    if rank == 0:
        for name, t in materialize(SOURCE, canonical(4)).items():
            worker.tensors[name].copy_(t)
    worker.refit(4)
    if rank == 1:
        report["after_4"] = mismatches(DEST, tensors, canonical(4))
    worker.close()
    Path(out, f"{rank}.json").write_text(json.dumps(report))


@pytest.mark.slow
def test_gloo_a_delayed_message_of_a_failed_step_never_completes_the_next() -> None:
    """The receiver loses step 2 before it posts a receive; the sender's step-2 messages
    are then in flight. Step 3 must fail on both ranks naming step 2 (before: the
    receiver's step 3 took the sender's step-2 messages and reported success)."""

    def endpoint(rank: int, port: int, secret: str) -> str:
        return RefitEndpoint(
            "127.0.0.1", port, 2, rank, timeout_s=20, connect_timeout_s=300, secret=secret
        ).to_json()

    first, second = (free_port(), new_secret()), (free_port(), new_secret())
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            multiprocessing.get_context("spawn").Process(
                target=_gloo_rank, args=(r, endpoint(r, *first), endpoint(r, *second), tmp)
            )
            for r in (0, 1)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        assert [p.exitcode for p in procs] == [0, 0]
        sender, receiver = (json.loads(Path(tmp, f"{r}.json").read_text()) for r in (0, 1))
    unusable = (
        "GroupUnusableError: refit rank {r}: refit group unusable: step 2 failed "
        "(TransportError: {why}); re-join the group (RefitWorker.rejoin) before the next refit"
    )
    assert receiver["1"] == sender["1"] == "completed"
    assert receiver["2"] == "TransportError: injected: this rank lost its step"
    assert receiver["3"] == unusable.format(r=1, why="injected: this rank lost its step")
    assert receiver["after_3"] > 0  # step 3's weights never arrived
    # The sender's step-2 messages found no receive of step 2: they timed out, named.
    assert sender["2"].startswith(
        "TransportError: refit rank 0: step 2 round 0: send with rank 1 timed out ("
    ), sender["2"]
    assert sender["3"].startswith(
        "GroupUnusableError: refit rank 0: refit group unusable: step 2 failed "
        "(TransportError: refit rank 0: step 2 round 0: send with rank 1 timed out ("
    ), sender["3"]
    assert receiver["after_4"] == []  # re-joined: bit-exact again


def _tagged(rank: int, port: int, out: str) -> None:
    """Rank 0 leaves a message of its step 1 in flight; rank 1, in step 2, must not take it."""
    transport = GlooTransport("127.0.0.1", port, rank, 2, timeout_s=10, connect_timeout_s=300)
    if rank == 0:
        transport.begin_step(1)
        transport.start_exchange([(1, torch.full((16,), 7, dtype=torch.uint8))], [], 0)
        transport.begin_step(2)  # nothing of step 2 for rank 1
        Path(out, "0.txt").write_text("sent")
        threading.Event().wait(60)  # keep the stale message alive until rank 1 is done
        os._exit(0)
    buf = torch.zeros(16, dtype=torch.uint8)
    transport.begin_step(1)  # nothing of step 1 for rank 1
    transport.begin_step(2)
    try:
        transport.exchange([], [(0, buf)], 0)
        text = f"received {buf.tolist()}"
    except TransportError as err:
        text = str(err)
    Path(out, "1.txt").write_text(text)
    os._exit(0)


@pytest.mark.slow
def test_gloo_tags_keep_a_stale_message_out_of_a_later_step(tmp_path) -> None:
    ctx = mp.start_processes(
        _tagged, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn", join=False
    )
    ctx.processes[1].join(600)
    for p in ctx.processes:
        p.kill()
    text = Path(tmp_path, "1.txt").read_text()
    assert text.startswith("refit rank 1: step 2 round 0: receive with rank 0 timed out ("), text


def test_message_tags_are_distinct_per_step_and_round() -> None:
    from nemo_refit_reshard.engine.transport import message_tag

    tags = {message_tag(s, r) for s in range(1, 40) for r in (0, 1, 2, 1000, 2**20 - 1)}
    assert len(tags) == 39 * 5 and all(0 <= t < 2**31 for t in tags)
    with pytest.raises(ValueError) as err:
        message_tag(1, 2**20)
    assert str(err.value) == (
        "round 1048576 outside the 1048576 rounds a step can tag; raise bucket_mb"
    )


# -- colocated: a stale signal of a failed step -----------------------------------------------
def test_a_stale_signal_names_both_steps() -> None:
    host, guest = multiprocessing.Pipe()
    Signals(host, 5, "vLLM worker").send("F", 1, 0)
    with pytest.raises(TransportError) as err:
        Signals(guest, 5, "training rank on this GPU").wait("F", 2, 0, step=8)
    assert str(err.value) == (
        "colocated refit step 8 (refit #2 here): the training rank on this GPU sent F1:0, a "
        "signal of refit #1 on this connection: a stale signal of a failed step; re-connect "
        "the worker"
    )


def test_colocated_a_stale_signal_of_a_failed_step_never_completes_the_next() -> None:
    """The worker gives up on step 2 (its host is late); the host then hands over step 2.
    The worker's step 3 must fail naming step 2 (before: it unpacked the host's step-2
    signals and bytes and reported success), and so must the host's late step 2."""
    secret = new_secret()
    endpoint = RefitEndpoint(
        "127.0.0.1", free_port(), 1, 0, timeout_s=60, connect_timeout_s=300, secret=secret
    )
    source = materialize(SOURCE, canonical(0))
    trainer = ColocatedTrainer(endpoint, source, COLOCATED)
    tensors = empty_like_layout(DEST)
    worker = ColocatedWorker(tensors)
    address = trainer.listen()
    assert address is not None
    connect = threading.Thread(
        target=worker.connect, args=(address, secret, rank_plan(COLOCATED, 1), 1, 3, 300)
    )
    connect.start()
    trainer.join()
    trainer.accept_worker()
    connect.join()
    out: dict[str, str] = {}
    worker_gave_up = threading.Event()

    def run_trainer() -> None:
        for step in (1, 2, 3):
            for name, t in materialize(SOURCE, canonical(step)).items():
                source[name].copy_(t)
            if step == 2:
                worker_gave_up.wait(300)
            try:
                trainer.refit(step)
                out[f"host{step}"] = "completed"
            except Exception as err:  # noqa: BLE001
                out[f"host{step}"] = f"{type(err).__name__}: {err}"

    thread = threading.Thread(target=run_trainer)
    thread.start()
    for step in (1, 2, 3):
        try:
            worker.refit(step)
            out[f"guest{step}"] = "completed"
        except Exception as err:  # noqa: BLE001
            out[f"guest{step}"] = f"{type(err).__name__}: {err}"
        if step == 1:
            out["after_1"] = str(mismatches(DEST, tensors, canonical(1)))
        if step == 2:
            worker_gave_up.set()
    thread.join(300)
    try:
        _check_stale_pair(out)
    finally:
        trainer.close()
        worker.close()


def _check_stale_pair(out: dict[str, str]) -> None:
    timed_out = (
        "TransportError: colocated refit: the training rank on this GPU did not signal "
        "round 0 within 3 s (it died or hung)"
    )
    assert out["guest1"] == out["host1"] == "completed" and out["after_1"] == "[]"
    assert out["guest2"] == timed_out
    assert out["guest3"] == (
        "GroupUnusableError: colocated refit unusable: step 2 failed on generation rank 1 "
        f"({timed_out}); re-connect the worker to a new trainer"
    )
    assert out["host2"] == (
        "TransportError: colocated refit: the vLLM worker on training rank 0's GPU failed in "
        f"round 0: {timed_out}"
    )
    assert out["host3"].startswith(
        "GroupUnusableError: colocated refit unusable: step 2 failed on training rank 0 "
        "(TransportError: colocated refit: the vLLM worker on training rank 0's GPU failed"
    ), out["host3"]


def test_colocated_attach_refuses_a_worker_of_another_plan() -> None:
    other = plan_refit(SPEC, [SOURCE], [DEST], bucket_mb=0.02, colocation=Colocation((0,)))
    host = ColocatedHost(rank_plan(COLOCATED, 0), rank_plan(COLOCATED, 1), 0, {
        **materialize(SOURCE, canonical(0))
    })  # fmt: skip
    guest = ColocatedGuest(rank_plan(other, 1), 1, empty_like_layout(DEST))
    a, b = multiprocessing.Pipe()
    errors: list[BaseException] = []

    def attach() -> None:
        try:
            guest.attach(b, 60)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    thread = threading.Thread(target=attach)
    thread.start()
    with pytest.raises(PlanError) as err:
        host.attach(a, 60)
    thread.join()
    host.close()
    want = (
        f"colocated refit: the training rank on this GPU holds plan "
        f"{COLOCATED.fingerprint[:16]}, generation rank 1 plan {other.fingerprint[:16]}; ship "
        "both from one plan"
    )
    assert str(err.value) == want
    assert [str(e) for e in errors] == [want]


# -- item 10: the host packs its own guest's bytes straight into the staging -----------------
def test_the_host_packs_its_own_guests_bytes_straight_into_the_staging() -> None:
    """Two training ranks (tp=2), two workers (tp=2), worker d on training rank d's GPU.
    What training rank 0 holds for its own worker is packed into the worker's staging
    (no send-buffer copy, no second, device-local copy): no send names its own worker,
    and the pack writes exactly the plan's device-local bytes into the staging."""
    sources = [megatron_layout(SPEC, TrainParallel(tp=2), r) for r in range(2)]
    dests = [vllm_layout(SPEC, InferParallel(tp=2), r) for r in range(2)]
    plan = plan_refit(SPEC, sources, dests, bucket_mb=0.01, colocation=Colocation((0, 1)))
    host = ColocatedHost(rank_plan(plan, 0), rank_plan(plan, 2), 0, materialize(
        sources[0], canonical(0)
    ))  # fmt: skip
    assert host.staging is not None
    staging = host.staging.tensor
    lo, hi = staging.data_ptr(), staging.data_ptr() + staging.numel()
    into_staging = sent_to_guest = 0
    for phase in host.own.rounds:
        sent_to_guest += sum(buf.numel() for peer, buf in phase.sends if peer == 2)
        for staged, _live in phase.copies_out:  # the send buffer: nothing for the guest
            assert not lo <= staged.data_ptr() < hi
        for staged, _live in phase.local_out:
            assert lo <= staged.data_ptr() < hi
            into_staging += staged.numel() * staged.element_size()
    local = sum(n for msgs in plan.traffic() for src, dst, n in msgs if (src, dst) == (0, 2))
    try:
        assert local > 0
        assert sent_to_guest == 0  # before: packed into the send buffer, then copied over
        assert into_staging == local
    finally:
        host.close()
