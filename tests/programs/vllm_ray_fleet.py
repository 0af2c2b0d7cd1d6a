"""Two vLLM engines side by side behind one Megatron trainer, through vLLM's weight-transfer
API with the ``reshard`` backend: one engine dies, the other goes on, a new one is admitted
(every party a Ray actor, vLLM's Python, CPU).

    python -m tests.programs.vllm_ray_fleet SPEC.json RESULT.json

SPEC: ``{"config", "train_tp", "infer": [EngineRank fields per worker rank of one engine],
"initial", "checkpoints": [three safetensors paths], "timeout_s"}``.

Each vLLM engine is its own refit group: every trainer rank calls ``trainer_init`` once per
engine, with vLLM's ``RayVLLMWeightSyncClient`` over that engine's ``LLM`` actor
(``tests/programs/vllm_ray_refit.py`` has the parties and the stand-ins). Steps:

1. engines ``a`` and ``b`` both take ``v1``;
2. ``b``'s worker ranks are killed; the update of ``b`` to ``v2`` fails on every trainer
   rank (its group only); ``b`` is fenced (the trainer engines of ``b`` shut down, vLLM's
   ``shutdown_weight_transfer_engine`` tried on its ``LLM``, which is then ended); ``a``
   takes ``v2`` through its own group, untouched;
3. engine ``c`` starts from the initial checkpoint (a restarted engine loads from disk)
   and is admitted: vLLM's ``init_weight_transfer_engine`` through ``trainer_init``, then
   its first update, ``v2`` (the version every other engine holds);
4. ``a`` and ``c`` take ``v3``.

Every worker checks each committed version bit for bit against vLLM's ``load_weights``
of the checkpoint that version names; the result reports each engine's version and
status after every phase, the failed updates' errors and how long each took.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import time
from typing import Any

import ray

from tests.programs.vllm_ray_refit import WAIT_S, MegatronTrainerRank, VllmWorkerRank, main


def start_engine(spec: dict[str, Any], initial: str) -> tuple[Any, list[Any]]:
    """One vLLM engine: its worker ranks loaded from ``initial``, and its ``LLM`` actor."""
    from tests.helpers.vllm_control_plane import cpu_llm_class

    workers = [
        VllmWorkerRank.remote(spec["config"], r, initial, spec["checkpoints"])
        for r in spec["infer"]
    ]
    ray.get([w.ready.remote() for w in workers], timeout=WAIT_S)
    return ray.remote(num_cpus=0)(cpu_llm_class()).remote(workers), workers


def engine_state(llm: Any) -> dict[str, Any]:
    """An engine's committed version (the ``LLM``'s) and every worker's status."""
    return {
        "version": ray.get(llm.get_weight_version.remote(), timeout=WAIT_S),
        "status": ray.get(llm.rpc.remote("status"), timeout=WAIT_S),
    }


def timed_syncs(trainers: list[Any], version: str, name: str) -> dict[str, Any]:
    """Every trainer rank's update of engine ``name``: the errors (None where it
    committed) and the seconds until the last rank returned."""
    start = time.monotonic()
    errors = ray.get([t.try_sync.remote(version, name) for t in trainers], timeout=WAIT_S)
    return {"errors": errors, "seconds": time.monotonic() - start}


def run(spec: dict[str, Any], work: str) -> dict[str, Any]:
    cfg, tp, checkpoints = spec["config"], spec["train_tp"], spec["checkpoints"]
    infer_tp, timeout_s = spec["infer"][0]["tp"], spec["timeout_s"]
    trainers = [MegatronTrainerRank.remote(cfg, tp, r, f"{work}/init") for r in range(tp)]
    ray.get([t.load.remote(checkpoints[0]) for t in trainers], timeout=WAIT_S)
    engines = {name: start_engine(spec, spec["initial"]) for name in ("a", "b")}

    def admit(name: str) -> list[str]:
        llm = engines[name][0]
        calls = [t.init_transfer.remote(llm, infer_tp, name=name, timeout_s=timeout_s)
                 for t in trainers]  # fmt: skip
        return ray.get(calls, timeout=WAIT_S)

    out: dict[str, Any] = {"fingerprints": {n: admit(n) for n in ("a", "b")}}
    out["step1"] = {n: timed_syncs(trainers, "v1", n) for n in ("a", "b")}

    # Step 2: engine b's workers die between steps; its update fails, a's does not.
    ray.get([t.load.remote(checkpoints[1]) for t in trainers], timeout=WAIT_S)
    for worker in engines["b"][1]:
        ray.kill(worker)
    out["step2"] = {n: timed_syncs(trainers, "v2", n) for n in ("b", "a")}
    ray.get([t.leave.remote("b") for t in trainers], timeout=WAIT_S)  # fence b
    try:
        ray.get(engines["b"][0].shutdown_weight_transfer_engine.remote(), timeout=WAIT_S)
        out["b_shutdown"] = None
    except ray.exceptions.RayError as err:  # its workers are gone: vLLM says so
        out["b_shutdown"] = type(err).__name__
    ray.kill(engines.pop("b")[0])
    out["after_loss"] = {"a": engine_state(engines["a"][0])}

    # Step 3: engine c (started from the initial checkpoint) admitted, caught up to v2.
    engines["c"] = start_engine(spec, spec["initial"])
    out["fingerprints"]["c"] = admit("c")
    out["catch_up"] = timed_syncs(trainers, "v2", "c")
    out["after_admission"] = {n: engine_state(engines[n][0]) for n in ("a", "c")}

    # Step 4: both engines take v3.
    ray.get([t.load.remote(checkpoints[2]) for t in trainers], timeout=WAIT_S)
    out["step3"] = {n: timed_syncs(trainers, "v3", n) for n in ("a", "c")}
    out["final"] = {n: engine_state(engines[n][0]) for n in ("a", "c")}
    out["workers"] = {
        n: ray.get([w.report.remote() for w in engines[n][1]], timeout=WAIT_S) for n in ("a", "c")
    }
    ray.get([t.leave.remote(n) for t in trainers for n in ("a", "c")], timeout=WAIT_S)
    return out


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1)  # a hung driver's stacks: kill -USR1 <pid>
    main(sys.argv[1], sys.argv[2], run)
