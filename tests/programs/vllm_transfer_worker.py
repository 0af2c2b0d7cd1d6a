"""One vLLM worker rank with the ``reshard`` weight-transfer engine (vLLM's Python).

    python -m tests.programs.vllm_transfer_worker SPEC.json RESULT.json

SPEC: ``{"config", "rank": EngineRank fields, "port", "authkey", "initial",
"checkpoints": [one safetensors path per step]}``.

vLLM's own model class is built on CPU with real float32 storage and loaded from the
start-up checkpoint; the engine comes from vLLM's ``WeightTransferEngineFactory`` for
``WeightTransferConfig(backend="reshard")``, as vLLM's worker makes it after loading the
model. The four phases then run through vLLM's own ``Worker`` methods (which keep the
session state and enforce their order) on a stand-in worker object that holds what
they read. The control-plane calls arrive over a socket from the test's
``PipeWeightSyncClient`` (the stand-in for ``collective_rpc``).

After every committed update each parameter must equal, bit for bit, what vLLM's own
``load_weights`` makes of that step's checkpoint, and no parameter storage may move.
"""

from __future__ import annotations

import faulthandler
import json
import signal
import sys
import traceback
from multiprocessing.connection import Listener
from types import SimpleNamespace
from typing import Any

import torch

from tests.helpers import vllm_cpu


class StandInWorker:
    """What vLLM's ``Worker`` weight-update methods read from the worker."""

    def __init__(self, engine: Any, vllm_config: Any, rank: int) -> None:
        self.weight_transfer_engine = engine
        self.vllm_config = vllm_config
        self.rank = rank
        self._weight_update_active = False
        self._weight_update_is_draft = False
        self.model_runner = SimpleNamespace(reset_lora_state=lambda: None)
        self.weight_version: str | None = None  # the engine's (LLM.update_weight_version)

    def get_draft_model(self) -> None:
        return None


# vLLM's own weight-update methods of its ``Worker``, run on the stand-in as they run on
# the real worker (the session state and order checks are theirs).
VLLM_WORKER_METHODS = (
    "_check_weight_transfer_engine",
    "_start_weight_update",
    "init_weight_transfer_engine",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
)


def main(spec_path: str, result_path: str) -> None:
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.v1.worker.gpu_worker import Worker

    from nemo_refit_reshard.integrations.vllm import plugin

    for name in VLLM_WORKER_METHODS:
        setattr(StandInWorker, name, getattr(Worker, name))
    spec = json.load(open(spec_path))
    rank = vllm_cpu.EngineRank.from_dict(spec["rank"])
    result: dict[str, Any] = {"ok": False, "committed": [], "steps": []}
    listener = Listener(("127.0.0.1", spec["port"]), authkey=spec["authkey"].encode())
    try:
        plugin.register()  # what vLLM's load_general_plugins() does via the entry point
        model, config = vllm_cpu.build_model(spec["config"], rank, "cpu", "float32")
        model.load_weights(vllm_cpu.checkpoint_tensors(spec["initial"]))
        engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="reshard"), config, torch.device("cpu"), model
        )
        result["engine"] = type(engine).__name__
        worker = StandInWorker(engine, config, rank.tp_rank)
        pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
        result["params"] = len(pointers)
        pending: dict[str, Any] = {}

        def check(step: int) -> None:
            truth, _ = vllm_cpu.build_model(spec["config"], rank, "cpu", "float32")
            truth.load_weights(vllm_cpu.checkpoint_tensors(spec["checkpoints"][step - 1]))
            want = dict(truth.named_parameters())
            result["steps"].append(
                {
                    "step": step,
                    "differ": [
                        n for n, p in model.named_parameters() if not torch.equal(p, want[n])
                    ],
                    "moved": [
                        n for n, p in model.named_parameters() if p.data_ptr() != pointers[n]
                    ],
                }
            )

        with listener.accept() as conn:
            while True:
                method, args = conn.recv()
                try:
                    value: Any = None
                    if method == "update_weights":
                        pending = dict(args[0])
                        worker.update_weights(args[0])
                    elif method == "finish_weight_update":
                        worker.finish_weight_update()
                        if args and args[0] is not None:
                            worker.weight_version = args[0]  # as LLM.update_weight_version
                        result["committed"].append(engine.weight_version)
                        check(int(pending["step"]))
                    elif method in ("init_weight_transfer_engine", "start_weight_update"):
                        getattr(worker, method)(*args)
                    elif method == "status":
                        value = {**engine.status(), "active": worker._weight_update_active}
                    elif method == "engine_finish":  # the engine alone, past vLLM's guard
                        engine.finish_weight_update()
                    elif method == "close":
                        engine.shutdown()
                        conn.send((True, None))
                        break
                    conn.send((True, value))
                except Exception as err:  # answered to the client, which raises
                    conn.send((False, f"{type(err).__name__}: {err}"))
        result["ok"] = True
    except BaseException as err:  # reported to the test, which asserts on it
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()
    finally:
        listener.close()
        with open(result_path, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1)  # a hung rank's stacks: kill -USR1 <pid>
    main(sys.argv[1], sys.argv[2])
