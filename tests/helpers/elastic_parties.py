"""Real processes as the parties of an elastic refit (``integrations/worker/membership.py``).

Every party is a spawned process holding a :class:`RefitWorker` over a tiny Llama's
layout (training: Megatron tp; inference: vLLM engines), driven through queues.
:class:`ProcessParties` implements the ``Parties`` protocol for the driver; faults are
staged per (party, step): ``("die", k)`` exits when round ``k`` starts, ``("hang", k)``
sleeps there, ``("raise", k)`` raises ``RuntimeError("injected")`` there.
"""

from __future__ import annotations

import os
import queue
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_refit_reshard.engine.materialize import empty_like_layout, materialize, mismatches
from nemo_refit_reshard.integrations.worker import RefitEndpoint, RefitWorker
from nemo_refit_reshard.integrations.worker.membership import DEAD, OK, SILENT, RefitGroup
from nemo_refit_reshard.layouts import megatron_layout, vllm_layout
from nemo_refit_reshard.plan import rank_plan
from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
from tests.helpers.hf_models import TINY_CONFIGS

SPEC = spec_from_hf_config(dict(TINY_CONFIGS["llama"], torch_dtype="float32"))


def canonical(step: int, sparse: bool = False) -> dict[str, torch.Tensor]:
    """The weights a training step leaves (step 0: the initial ones). ``sparse``: each
    step changes one element of every tensor (a delta refit's case), else all of them."""
    if not sparse:
        g = torch.Generator().manual_seed(1000 + step)
        return {t.name: torch.randn(t.shape, generator=g) for t in SPEC}
    out = canonical(0)
    for s in range(1, step + 1):
        for t in out.values():
            t.view(-1)[(s * 7919) % t.numel()] += float(s)
    return out


def layout(party: tuple, train: str, infer: str):
    if party[0] == "training":
        return megatron_layout(SPEC, TrainParallel.parse(train), party[1])
    ip = InferParallel.parse(infer)
    return vllm_layout(SPEC, ip, party[1] * ip.engine_world_size + party[2])


def _outcome(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"raised {type(err).__name__}: {lines[0] if lines else ''}"


def _stage(transport: Any, fault: tuple[str, int]) -> None:
    kind, at = fault
    start, started = transport.start_exchange, [0]

    def faulty(sends, recvs, *round_index):
        if started[0] == at:
            if kind == "die":
                os._exit(3)
            if kind == "hang":
                time.sleep(3600)
            raise RuntimeError("injected")
        started[0] += 1
        return start(sends, recvs, *round_index)

    transport.start_exchange = faulty


def party_main(
    party: tuple, train: str, infer: str, commands: Any, replies: Any, sparse: bool = False
) -> None:
    lay = layout(party, train, infer)
    training = party[0] == "training"
    tensors = materialize(lay, canonical(0)) if training else empty_like_layout(lay)
    worker: RefitWorker | None = None
    while True:
        cmd = commands.get()
        try:
            if cmd[0] == "exit":
                if worker is not None:
                    worker.close()
                return
            if cmd[0] == "join":
                endpoint = RefitEndpoint.from_json(cmd[1])
                if worker is None:
                    worker = RefitWorker(endpoint, tensors)
                    worker.join()
                    worker.load_plan(cmd[2])
                else:
                    worker.rejoin(endpoint, cmd[2], cmd[3])
                replies.put(OK)
            elif cmd[0] == "train":
                for name, t in materialize(lay, canonical(cmd[1], sparse)).items():
                    tensors[name].copy_(t)
                replies.put(OK)
            elif cmd[0] == "refit":
                assert worker is not None and worker.transport is not None
                if cmd[2] is not None:
                    _stage(worker.transport, cmd[2])
                worker.refit(cmd[1])
                replies.put(OK)
            elif cmd[0] == "delta":  # the last delta step's stats on this rank
                assert worker is not None and worker.refitter is not None
                last = worker.refitter.delta.last  # type: ignore[union-attr]
                replies.put({"version": last.version, "forms": last.forms,
                             "received": last.received})  # fmt: skip
            elif cmd[0] == "report":
                state = worker.weights.as_dict() if worker is not None else None
                step = state["step"] if state else None
                wanted = None if step is None else canonical(step, sparse)
                wrong = None if wanted is None else len(mismatches(lay, tensors, wanted))
                replies.put({"weights": state, "mismatches": wrong})
        except Exception as err:  # noqa: BLE001 - reported to the driver as an outcome
            replies.put(_outcome(err))


@dataclass
class ProcessParties:
    """Spawned party processes, the driver's ``Parties``."""

    train: str
    infer: str
    deadline_s: float  # how long the driver waits for a refit's answers
    settle_s: float | None = None  # ... and for the last one after all others answered
    sparse: bool = False  # canonical(step, sparse): one element per tensor per step
    join_deadline_s: float = 600.0
    procs: dict[tuple, Any] = field(default_factory=dict)
    faults: dict[tuple, tuple[str, int]] = field(default_factory=dict)  # (party, step)
    calls: list[dict[str, Any]] = field(default_factory=list)  # every refit call

    def __post_init__(self) -> None:
        import torch.multiprocessing as mp

        self.ctx = mp.get_context("spawn")

    def start(self, party: tuple) -> None:
        old = self.procs.pop(party, None)
        if old is not None and old[0].is_alive():
            old[0].kill()
        commands, replies = self.ctx.Queue(), self.ctx.Queue()
        proc = self.ctx.Process(
            target=party_main,
            args=(party, self.train, self.infer, commands, replies, self.sparse),
        )
        proc.start()
        self.procs[party] = (proc, commands, replies)

    def start_engine(self, engine: int) -> None:
        for i in range(InferParallel.parse(self.infer).engine_world_size):
            self.start(("engine", engine, i))

    def stop_engine(self, engine: int) -> None:
        """What a driver does to a fenced engine's processes: end them."""
        for party, (proc, _, _) in self.procs.items():
            if party[0] == "engine" and party[1] == engine and proc.is_alive():
                proc.kill()
                proc.join(30)

    def _collect(
        self, parties: list[tuple], deadline_s: float, settle_s: float | None = None
    ) -> dict[tuple, Any]:
        """Every party's answer; DEAD when its process is gone, SILENT when it has not
        answered by ``deadline_s`` or ``settle_s`` after every other party answered."""
        t0 = time.monotonic()
        end = t0 + deadline_s
        out: dict[tuple, Any] = {}
        self.answered_s: dict[tuple, float] = {}
        while len(out) < len(parties):
            for party in parties:
                if party in out:
                    continue
                proc, _, replies = self.procs[party]
                try:
                    out[party] = replies.get(timeout=0.05)
                except queue.Empty:
                    if not proc.is_alive():
                        out[party] = DEAD
                if party in out:
                    self.answered_s[party] = time.monotonic() - t0
            now = time.monotonic()
            if settle_s is not None and len(out) == len(parties) - 1 and out:
                end = min(end, t0 + max(self.answered_s.values()) + settle_s)
            if now > end:
                for party in parties:
                    out.setdefault(party, SILENT)
        return out

    def send(self, parties: list[tuple], command: tuple) -> dict[tuple, Any]:
        for party in parties:
            self.procs[party][1].put(command)
        return self._collect(parties, self.join_deadline_s)

    def join(self, group: RefitGroup) -> dict[tuple, str]:
        plan = group.plan.plan
        for party, endpoint in group.endpoints.items():
            text = rank_plan(plan, endpoint.group_rank).to_json()
            self.procs[party][1].put(("join", endpoint.to_json(), text, group.version))
        return self._collect(list(group.endpoints), self.join_deadline_s)

    def refit(self, group: RefitGroup, step: int) -> dict[tuple, str]:
        t0 = time.monotonic()
        for party in group.endpoints:
            self.procs[party][1].put(("refit", step, self.faults.pop((party, step), None)))
        out = self._collect(list(group.endpoints), self.deadline_s, self.settle_s)
        self.calls.append(
            {"step": step, "engines": group.engines, "seconds": time.monotonic() - t0,
             "answered_s": dict(self.answered_s), "outcomes": out}
        )  # fmt: skip
        return out

    def train_to(self, step: int) -> None:
        trainers = [p for p in self.procs if p[0] == "training"]
        assert set(self.send(trainers, ("train", step)).values()) == {OK}

    def delta(self, parties: list[tuple]) -> dict[tuple, Any]:
        return self.send(parties, ("delta",))

    def reports(self, engines: list[int]) -> dict[tuple, Any]:
        parties = [p for p in self.procs if p[0] == "engine" and p[1] in engines]
        return self.send(parties, ("report",))

    def close(self) -> None:
        for proc, commands, _ in self.procs.values():
            if proc.is_alive():
                commands.put(("exit",))
        for proc, _, _ in self.procs.values():
            proc.join(30)
            if proc.is_alive():
                proc.kill()
