"""Delta refit through vLLM's weight-transfer API (``reshard`` backend, ``delta=True``),
every party a Ray actor (vLLM's Python, CPU).

    python -m tests.programs.vllm_delta_refit SPEC.json RESULT.json

SPEC: ``{"config", "seed", "infer": [EngineRank fields per worker rank]}``.

* Trainer ranks (2, torch.distributed over gloo): the policy's BF16 tensors as FSDP2
  shards (``DTensorSource``, every tensor ``Shard(0)``); each update changes about 1 %
  of their elements in place (``tests/helpers/delta_updates.change_some``). Each
  builds the trainer engine with vLLM's ``WeightTransferTrainerFactory.trainer_init``
  from ``ReshardTrainerInitInfo(delta=True)``; rank 0 drives vLLM's own
  ``RayVLLMWeightSyncClient``.
* The ``LLM`` actor: vLLM's ``RLOfflineMixin`` over the stand-in engine core
  (``tests/helpers/vllm_control_plane.py``).
* Worker ranks (one tp=2 engine, vLLM's own model class in BF16): the engine from vLLM's
  ``WeightTransferEngineFactory`` for ``WeightTransferConfig(backend="reshard")``, the
  phases run by vLLM's own ``Worker`` methods on a stand-in worker that also carries
  ``ReshardWorkerExtension`` (as ``worker_extension_cls`` does), its
  ``init_worker_extension`` hook run as vLLM runs it, and a stand-in ``sleep``: vLLM's
  CPU worker's does nothing, a GPU's level 2 discards the weights (here: NaN). Every
  call reaches the worker through vLLM's ``run_method``, by name, as ``collective_rpc``.

Phases: 4 updates (separate pools); worker 1 sleeps at level 2 and worker 0 at level 1,
one update; worker 0's weights poisoned and ``refit_forget_weights`` called, one update;
worker 1's weights poisoned *without* forgetting, one update (the per-step base check,
``engine/delta/check.py``, sends it dense); then colocated (re-initialised through
vLLM's own calls, every worker poisoned), 3 updates. After each update every worker
compares its parameters bit for bit with vLLM's ``load_weights`` of the trainer's
policy, and every rank reports its delta statistics.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import ray

from tests.helpers.driver_report import report_to
from tests.helpers.vllm_delta_ranks import WAIT_S, TrainerRank, VllmWorkerRank


def refusals() -> list[str]:
    """What ``trainer_init`` says to bad delta options (checked before it plans)."""
    from nemo_refit_reshard.integrations.vllm.transfer_trainer import (
        ReshardTrainerInitInfo,
        delta_options,
    )

    out = []
    for bad in (
        {"delta": "yes"},
        {"delta_anchor_every": 2},
        {"delta": True, "delta_anchor_every": -1},
        {"delta": True, "delta_baseline": "gpu"},
    ):
        try:
            delta_options(ReshardTrainerInitInfo(rank=0, **bad))  # type: ignore[arg-type]
            out.append("not refused")
        except ValueError as err:
            out.append(str(err))
    return out


def run(spec: dict[str, Any], work: str) -> dict[str, Any]:
    from nemo_refit_reshard.integrations.vllm import refit_forget_weights
    from tests.helpers.vllm_control_plane import cpu_llm_class

    cfg, seed = spec["config"], spec["seed"]
    workers = [VllmWorkerRank.remote(cfg, r, seed) for r in spec["infer"]]
    llm = ray.remote(num_cpus=0)(cpu_llm_class()).remote(workers)
    trainers = [TrainerRank.remote(cfg, r, seed, f"{work}/init") for r in range(2)]
    infer_tp = spec["infer"][0]["tp"]
    get = lambda refs: ray.get(refs, timeout=WAIT_S)  # noqa: E731
    policy = 0
    updates: list[dict[str, Any]] = []

    def update(name: str) -> None:
        nonlocal policy
        policy += 1
        get([t.update.remote(policy) for t in trainers])
        stats = get([t.sync.remote(name) for t in trainers])
        updates.append(
            {
                "name": name,
                "trainers": stats,
                "workers": get([w.execute.remote("delta") for w in workers]),
                "differ": get([w.execute.remote("check", policy) for w in workers]),
            }
        )

    out: dict[str, Any] = {"updates": updates, "refusals": refusals()}
    get([t.init_transfer.remote(llm, infer_tp, False) for t in trainers])
    for k in range(1, 5):
        update(f"v{k}")
    # vLLM dispatches sleep by name (collective_rpc("sleep", ...)): the wrapped method.
    get([workers[1].execute.remote("sleep", level=2), workers[0].execute.remote("sleep", level=1)])
    get([w.execute.remote("wake_up") for w in workers])
    update("after_sleep")
    get(workers[0].execute.remote("poison"))
    out["forgot"] = get(workers[0].execute.remote(refit_forget_weights))
    update("after_forget")
    get(workers[1].execute.remote("poison"))  # nothing forgotten: the base check finds it
    update("unforgotten")
    get([t.leave.remote() for t in trainers])
    get(llm.shutdown_weight_transfer_engine.remote())
    get(llm.rpc.remote("poison"))
    get([t.init_transfer.remote(llm, infer_tp, True) for t in trainers])
    for k in range(1, 4):
        update(f"c{k}")
    out["llm_version"] = get(llm.get_weight_version.remote())
    return out


def main(spec_path: str, result_path: str) -> None:
    import os

    spec = json.load(open(spec_path))
    try:
        with report_to(result_path) as result:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
            result.update(run(spec, os.path.dirname(os.path.abspath(spec_path))))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
