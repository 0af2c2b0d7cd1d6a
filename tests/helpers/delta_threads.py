"""A whole refit group in one process for delta tests: every rank a thread over a real
gloo group, Adam steps between refits on the driver thread (``runner/training.py``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nemo_refit_reshard.engine.delta import DeltaOptions
from nemo_refit_reshard.engine.materialize import materialize
from nemo_refit_reshard.engine.refit import Refitter
from nemo_refit_reshard.engine.rendezvous import new_rendezvous
from nemo_refit_reshard.engine.transport import GlooTransport
from nemo_refit_reshard.layouts import refit_layouts
from nemo_refit_reshard.plan import plan_refit
from nemo_refit_reshard.runner.config import RunConfig
from nemo_refit_reshard.runner.destination import destination_tensors
from nemo_refit_reshard.runner.training import AdamTrainedWeights, refill
from nemo_refit_reshard.spec import InferParallel, TrainParallel, load_model_spec


def on_threads(world: int, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(rank)`` for every rank at once, each on a thread; re-raise the first error."""
    results: list[Any] = [None] * world
    errors: list[BaseException | None] = [None] * world

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as err:  # re-raised on the caller's thread
            errors[rank] = err

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for err in errors:
        if err is not None:
            raise err
    return results


class DeltaGroup:
    """Training and inference ranks of one model, refit with deltas step after step."""

    def __init__(
        self,
        config: dict[str, Any],
        work: Path,
        train: str,
        infer: str,
        lr: float = 1e-5,
        relay: str = "none",
        options: DeltaOptions | None = None,
        bucket_mb: float = 512,
    ) -> None:
        import json

        path = work / "config.json"
        path.write_text(json.dumps(config))
        self.spec = load_model_spec(str(path))
        self.sources, self.destinations = refit_layouts(
            self.spec, TrainParallel.parse(train), InferParallel.parse(infer)
        )
        self.plan = plan_refit(self.spec, self.sources, self.destinations, bucket_mb, relay=relay)
        self.trained = AdamTrainedWeights(self.spec.unquantized(), seed=0, lr=lr)
        s = len(self.sources)
        self.num_sources = s
        self.world = s + len(self.destinations)
        self.tensors = [materialize(layout, self.trained) for layout in self.sources]
        cfg = RunConfig(model=str(path), train=train, infer=infer)
        self.inference = [
            destination_tensors(cfg, self.spec, layout, d, self.trained, torch.device("cpu"))
            for d, layout in enumerate(self.destinations)
        ]
        self.tensors += [mine.tensors for mine in self.inference]
        meet = new_rendezvous()
        options = options or DeltaOptions()

        def join(rank: int) -> Refitter:
            transport = GlooTransport(
                meet.ip, meet.port, rank, self.world, timeout_s=120, secret=meet.secret
            )
            return Refitter(self.plan, rank, self.tensors[rank], transport, delta=options)

        self.refitters: list[Refitter] = on_threads(self.world, join)

    def train_step(self) -> None:
        """One Adam step: training ranks' tensors hold the new weights."""
        self.trained.advance()
        for layout, tensors in zip(self.sources, self.tensors):
            refill(layout, tensors, self.trained)
        for mine in self.inference:
            mine.retrain(self.trained)

    def refit(self) -> None:
        on_threads(self.world, lambda rank: self.refitters[rank].refit())

    def mismatches(self) -> list[list[str]]:
        """Per inference rank, its tensors that differ from the trained weights."""
        return [mine.mismatches() for mine in self.inference]

    def delta(self, rank: int):
        program = self.refitters[rank].delta
        assert program is not None
        return program

    def wire_bytes(self) -> tuple[int, int]:
        """``(sent, dense)`` bytes of the last step over every training rank."""
        stats = [self.delta(r).last for r in range(self.num_sources)]
        return sum(s.sent_bytes for s in stats), sum(s.dense_bytes for s in stats)

    def close(self) -> None:
        for refitter in self.refitters:
            refitter.transport.close()
