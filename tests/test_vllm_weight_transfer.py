"""``reshard`` as a backend of vLLM's own weight-transfer API, on CPU with vLLM 0.33.

Two trainer ranks (Megatron tp=2 shards) build the trainer engine through vLLM's
``WeightTransferTrainerFactory.trainer_init``; two vLLM worker ranks (one tp=2 engine,
vLLM's own model classes with real float32 storage) build the worker engine through
vLLM's ``WeightTransferEngineFactory`` from ``WeightTransferConfig(backend="reshard")``
and run the four phases through vLLM's own ``Worker`` methods. The control plane
between the test processes is a stand-in for ``collective_rpc``
(``tests/helpers/pipe_sync_client.py``); everything else is vLLM's and ours.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from nemo_refit_reshard.engine.rendezvous import free_port, new_secret
from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config
from tests.helpers import vllm_env
from tests.test_vllm_truth import MODELS, rank_fields
from tests.test_vllm_worker import write_checkpoints

_SKIP = vllm_env.skip_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]


def run(model: str, work: Path, steps: int, fail_after: int | None = None) -> dict[str, Any]:
    """Trainer ranks and vLLM worker ranks, each a process; their results."""
    cfg = MODELS[model]
    train, infer = TrainParallel(tp=2), InferParallel(tp=2)
    initial, *checkpoints = write_checkpoints(spec_from_hf_config(cfg, name=model), work, steps)
    authkey, workers = new_secret()[:32], [("127.0.0.1", free_port()) for _ in range(2)]
    procs, outs = [], {}
    for d, (_, port) in enumerate(workers):
        path, out = work / f"worker{d}.json", work / f"worker{d}.out.json"
        path.write_text(
            json.dumps(
                dict(
                    config=cfg,
                    rank=rank_fields(infer, d, None),
                    port=port,
                    authkey=authkey,
                    initial=initial,
                    checkpoints=checkpoints,
                )
            )
        )
        procs.append(vllm_env.start("vllm_transfer_worker", str(path), str(out)))
        outs[f"worker{d}"] = out
    port, secret = free_port(), new_secret()
    for r in range(train.world_size):
        path, out = work / f"trainer{r}.json", work / f"trainer{r}.out.json"
        path.write_text(
            json.dumps(
                dict(
                    config=cfg,
                    train=str(train),
                    rank=r,
                    vllm_parallel={"tp": infer.tp},
                    port=port,
                    secret=secret,
                    workers=workers,
                    authkey=authkey,
                    checkpoints=checkpoints,
                    fail_after=fail_after,
                )
            )
        )
        procs.append(vllm_env.start("vllm_transfer_trainer", str(path), str(out)))
        outs[f"trainer{r}"] = out
    # A hung rank must fail the test, not the CI job's time limit.
    watchdog = threading.Timer(540, lambda: [p.kill() for p in procs if p.poll() is None])
    watchdog.start()
    try:
        for p in procs:
            vllm_env.finish(p, "a rank")
    finally:
        watchdog.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return {k: json.loads(v.read_text()) for k, v in outs.items()}


def test_reshard_backend_four_phases_bit_exact_then_failed_update(tmp_path: Path) -> None:
    """Two versions committed bit-exact vs vLLM's load_weights; the third update fails
    (a trainer rank left) and commits nothing."""
    results = run("qwen3_moe", tmp_path, steps=3, fail_after=2)
    for name, r in results.items():
        assert r["ok"], (name, r.get("traceback"))
    assert {results[f"trainer{r}"]["engine"] for r in (0, 1)} == {
        "ReshardTrainerWeightTransferEngine"
    }
    assert results["trainer0"]["fingerprint"] == results["trainer1"]["fingerprint"]
    for d in (0, 1):
        w = results[f"worker{d}"]
        assert w["engine"] == "ReshardWeightTransferEngine"
        assert w["committed"] == ["v1", "v2"]
        assert [s["step"] for s in w["steps"]] == [1, 2]
        assert [s["differ"] for s in w["steps"]] == [[], []], w["steps"]
        assert [s["moved"] for s in w["steps"]] == [[], []]
    t0 = results["trainer0"]
    assert t0["failed_update"] is not None
    for status in t0["status"]:
        assert status["weight_version"] == "v2" and status["step"] == 2
        assert status["stale"] and "step 3" in status["stale"], status
        assert status["active"] is False  # vLLM's Worker ended the failed session
    assert "StaleWeightsError" in t0["engine_finish"], t0["engine_finish"]
    assert "version 'v2'" in t0["engine_finish"]
