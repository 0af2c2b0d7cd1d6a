"""Overlapped replay (``engine/pipeline.py``): its order, its buffer reuse, its errors.

The order is device independent, so it is checked here on CPU: exactly which pack,
start, wait and unpack come when; and, over real compiled programs of every rank run
in threads, that no staging buffer is reused while the transport still owns it. For
that the transport below may deliver a message at the latest legal moment (when both
ends wait: a sender's bytes are read then, so a premature overwrite corrupts them) or
at the earliest (when both ends have started: a receiver's bytes land then, so a
premature reuse clobbers an unread round). Both must leave every destination
bit-exact; the negative control — overlapped replay on one staging set — must not.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest
import torch

from nemo_refit_reshard.engine.materialize import empty_like_layout, materialize, mismatches
from nemo_refit_reshard.engine.pipeline import replay_overlapped
from nemo_refit_reshard.engine.program import RankProgram
from nemo_refit_reshard.engine.transport import TransportError
from nemo_refit_reshard.layouts import megatron_layout, vllm_layout
from nemo_refit_reshard.plan import plan_refit
from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
from tests.helpers.carried_plan import SPEC as CARRIED_SPEC
from tests.helpers.carried_plan import carried_plan
from tests.helpers.hf_models import TINY_CONFIGS


# -- the order ------------------------------------------------------------------------
@dataclass
class LoggedPhase:
    k: int
    log: list[str]
    reads_previous: bool = False
    sends: list = field(default_factory=lambda: [(1, None)])
    recvs: list = field(default_factory=list)

    def pack(self) -> None:
        self.log.append(f"pack{self.k}")

    def unpack(self) -> None:
        self.log.append(f"unpack{self.k}")


class LoggedTransport:
    def __init__(self, log: list[str]) -> None:
        self.log, self.started = log, 0

    def start_exchange(self, sends, recvs, round_index=0):
        assert round_index == self.started  # each exchange names its round
        k = self.started
        self.started += 1
        self.log.append(f"start{k}")
        log = self.log

        class Pending:
            def wait(self) -> None:
                log.append(f"wait{k}")

        return Pending()


def test_order_overlaps_neighbouring_rounds() -> None:
    log: list[str] = []
    replay_overlapped([LoggedPhase(k, log) for k in range(3)], LoggedTransport(log))
    assert log == [
        "pack0", "start0",
        "pack1", "wait0", "start1", "unpack0",
        "pack2", "wait1", "start2", "unpack1",
        "wait2", "unpack2",
    ]  # fmt: skip


def test_a_round_sending_carried_bytes_waits_for_their_unpack() -> None:
    log: list[str] = []
    phases = [LoggedPhase(0, log), LoggedPhase(1, log, reads_previous=True), LoggedPhase(2, log)]
    replay_overlapped(phases, LoggedTransport(log))
    assert log == [
        "pack0", "start0",
        "wait0", "unpack0", "pack1", "start1",
        "pack2", "wait1", "start2", "unpack1",
        "wait2", "unpack2",
    ]  # fmt: skip


def test_a_failed_wait_stops_the_step() -> None:
    log: list[str] = []

    class Failing(LoggedTransport):
        def start_exchange(self, sends, recvs, round_index=0):
            pending = super().start_exchange(sends, recvs, round_index)
            if self.started == 2:

                class Dead:
                    def wait(self) -> None:
                        raise TransportError("refit rank 0: receive with rank 1 timed out")

                return Dead()
            return pending

    with pytest.raises(TransportError, match="timed out"):
        replay_overlapped([LoggedPhase(k, log) for k in range(3)], Failing(log))
    # round 1's wait raised: nothing after it ran (round 2 was packed, never started)
    assert log == ["pack0", "start0", "pack1", "wait0", "start1", "unpack0", "pack2"]


# -- buffer reuse over real programs ------------------------------------------------------
class ThreadedHub:
    """Every rank's transport, one thread per rank. Each exchange posts its sends and
    receives; a message moves src buffer -> dst buffer ("late": when both ends wait;
    "early": as soon as both ends started). ``wait`` returns once all of its messages
    moved."""

    def __init__(self, world: int, mode: str, timeout_s: float = 120.0) -> None:
        self.mode, self.timeout_s = mode, timeout_s
        self.cond = threading.Condition()
        # (src, dst) -> messages in posting order: [send, recv, waits, moved]
        self.posted: dict[tuple[int, int], list[list]] = {}
        self.world = world

    def transport(self, rank: int):
        return _HubTransport(self, rank)

    def _post(self, key: tuple[int, int], slot: int, buf: torch.Tensor) -> list:
        with self.cond:
            queue = self.posted.setdefault(key, [])
            entry = next((e for e in queue if e[slot] is None), None)
            if entry is None:
                entry = [None, None, 0, False]
                queue.append(entry)
            entry[slot] = buf
            if self.mode == "early" and entry[0] is not None and entry[1] is not None:
                self._move(key, entry)
            self.cond.notify_all()
            return entry

    def _move(self, key, entry) -> None:
        send, recv = entry[0], entry[1]
        assert send.numel() == recv.numel(), key
        recv.copy_(send)
        entry[3] = True

    def _wait(self, entries: list[tuple[tuple[int, int], list]]) -> None:
        with self.cond:
            for key, entry in entries:
                entry[2] += 1
                if self.mode == "late" and entry[2] == 2:
                    self._move(key, entry)
            self.cond.notify_all()
            ok = self.cond.wait_for(lambda: all(e[3] for _, e in entries), self.timeout_s)
            assert ok, "exchange never completed"
            for key, entry in entries:  # both ends done with it: forget it (by identity)
                if entry[2] == 2:
                    self.posted[key] = [e for e in self.posted[key] if e is not entry]


class _HubTransport:
    def __init__(self, hub: ThreadedHub, rank: int) -> None:
        self.hub, self.rank = hub, rank

    def start_exchange(self, sends, recvs, round_index=0):
        entries = [((self.rank, p), self.hub._post((self.rank, p), 0, b)) for p, b in sends]
        entries += [((p, self.rank), self.hub._post((p, self.rank), 1, b)) for p, b in recvs]
        hub = self.hub

        class Pending:
            def wait(self) -> None:
                hub._wait(entries)

        return Pending()

    def exchange(self, sends, recvs, round_index=0) -> None:
        self.start_exchange(sends, recvs, round_index).wait()


def _run_threads(programs: list[RankProgram], hub: ThreadedHub) -> None:
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            programs[rank].replay(hub.transport(rank))
        except BaseException as err:  # noqa: BLE001 - re-raised below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(programs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _dense_plan():
    spec = spec_from_hf_config(dict(TINY_CONFIGS["qwen3"], torch_dtype="float32"))
    train, infer = TrainParallel(tp=2, pp=2), InferParallel(tp=2, dp=2)
    sources = [megatron_layout(spec, train, r) for r in range(train.world_size)]
    destinations = [vllm_layout(spec, infer, d) for d in range(infer.world_size)]
    # A small bucket: many rounds, each rank in several of them.
    return plan_refit(spec, sources, destinations, bucket_mb=0.004), spec, sources, destinations


def _refit(
    plan, spec, sources, destinations, mode: str, sets: int, serial: bool = False
) -> list[list[str]]:
    """One overlapped refit; per destination rank, the tensors that came out wrong."""
    canonical = {
        t.name: torch.randn(t.shape, generator=torch.Generator().manual_seed(3)) for t in spec
    }
    src = [materialize(lay, canonical) for lay in sources]
    dst = [empty_like_layout(lay) for lay in destinations]
    s = len(sources)
    programs = [RankProgram(plan, r, src[r], overlap=True) for r in range(s)]
    programs += [RankProgram(plan, s + d, dst[d], overlap=True) for d in range(len(dst))]
    if sets == 1:  # negative control: overlapped order on a single staging set
        for p in programs:
            for k, phase in enumerate(p.rounds):
                if k % 2:
                    _rebind_to_first_set(p, phase)
            p.overlap = not serial
    _run_threads(programs, ThreadedHub(len(programs), mode))
    return [mismatches(lay, t, canonical) for lay, t in zip(destinations, dst)]


def _rebind_to_first_set(program: RankProgram, phase) -> None:
    """Point an odd round's staging views at set 0 (same offsets)."""

    def moved(view: torch.Tensor, sets: list[torch.Tensor]) -> torch.Tensor:
        base = sets[1]
        offset = view.data_ptr() - base.data_ptr()
        if not 0 <= offset < max(base.numel(), 1):
            return view  # a live tensor or the relay buffer
        flat = sets[0][offset : offset + view.numel() * view.element_size()]
        return flat.view(view.dtype).view(view.shape)

    phase.copies_out = [(moved(d, program.send_buffers), s) for d, s in phase.copies_out]
    phase.copies_in = [(d, moved(s, program.recv_buffers)) for d, s in phase.copies_in]
    phase.sends = [(p, moved(b, program.send_buffers)) for p, b in phase.sends]
    phase.recvs = [(p, moved(b, program.recv_buffers)) for p, b in phase.recvs]


@pytest.mark.parametrize("mode", ["late", "early"])
def test_overlapped_refit_is_bit_exact(mode: str) -> None:
    plan, spec, sources, destinations = _dense_plan()
    assert plan.stats.num_rounds >= 6
    assert _refit(plan, spec, sources, destinations, mode, sets=2) == [[]] * 4


@pytest.mark.parametrize("mode", ["late", "early"])
def test_carried_bytes_survive_the_overlap(mode: str) -> None:
    plan, sources, destinations, _ = carried_plan()
    assert any(
        p.reads_previous
        for p in RankProgram(plan, 0, _zeros(sources[0]), overlap=True).rounds
        + RankProgram(plan, 1, _zeros(sources[1]), overlap=True).rounds
    )
    assert _refit(plan, CARRIED_SPEC, sources, destinations, mode, sets=2) == [[]] * 2


@pytest.mark.parametrize("mode", ["late", "early"])
def test_chain_relayed_bytes_survive_the_overlap(mode: str) -> None:
    """Inference replicas forward what they received the round before, from their own
    live tensors: that pack must follow the unpack that wrote them."""
    spec = spec_from_hf_config(dict(TINY_CONFIGS["llama"], torch_dtype="float32"))
    train, infer = TrainParallel(tp=2), InferParallel(tp=1, dp=4)
    sources = [megatron_layout(spec, train, r) for r in range(2)]
    destinations = [vllm_layout(spec, infer, d) for d in range(4)]
    plan = plan_refit(spec, sources, destinations, bucket_mb=0.01, relay="chain")
    forwarding = RankProgram(plan, 3, empty_like_layout(destinations[1]), overlap=True)
    assert any(p.reads_previous for p in forwarding.rounds)
    assert _refit(plan, spec, sources, destinations, mode, sets=2) == [[]] * 4


def test_negative_control_one_staging_set_corrupts() -> None:
    """Packing round k+1 into the buffer round k is still being sent from: wrong bytes
    arrive. (Shows the bit-exact test above can fail.)"""
    plan, spec, sources, destinations = _dense_plan()
    wrong = _refit(plan, spec, sources, destinations, "late", sets=1)
    assert any(wrong), wrong
    # the same rebound programs replayed serially are exact: the overlap is what breaks
    assert _refit(plan, spec, sources, destinations, "late", sets=1, serial=True) == [[]] * 4


def _zeros(layout) -> dict[str, torch.Tensor]:
    return empty_like_layout(layout)
