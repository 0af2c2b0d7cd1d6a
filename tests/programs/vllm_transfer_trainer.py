"""One trainer rank driving the ``reshard`` weight-transfer backend (vLLM's Python).

    python -m tests.programs.vllm_transfer_trainer SPEC.json RESULT.json

SPEC: ``{"config", "train", "rank", "vllm_parallel", "port", "secret", "workers":
[[host, port], ...], "authkey", "checkpoints", "fail_after"}``.

The trainer engine comes from vLLM's own ``WeightTransferTrainerFactory.trainer_init``
with a ``ReshardTrainerInitInfo``; every rank sends its Megatron-layout shards (the
tensors a Megatron-core model of that layout holds, filled from each step's checkpoint
in place, as an optimizer step does). Rank 0 drives the workers through the test's
``PipeWeightSyncClient``. With ``fail_after`` = n, rank 1 leaves the group after n
updates and rank 0 tries update n+1, which must fail and commit nothing.
"""

from __future__ import annotations

import faulthandler
import json
import signal
import sys
import traceback
from typing import Any

import torch
from safetensors.torch import load_file

from nemo_refit_reshard.integrations.vllm.transfer_sources import ReshardSource
from nemo_refit_reshard.layouts import MegatronOptions, RankLayout, megatron_layouts
from nemo_refit_reshard.spec import TrainParallel, spec_from_hf_config
from tests.helpers.pipe_sync_client import PipeWeightSyncClient
from tests.helpers.vllm_reference import materialize


class MegatronShards(ReshardSource):
    """A Megatron rank's local tensors in a dict (what ``MegatronSource`` reads off a
    live Megatron-core model), without building the model."""

    def __init__(self, spec: Any, parallel: TrainParallel, rank: int) -> None:
        self.spec, self.parallel, self.rank = spec, parallel, rank
        self.all = megatron_layouts(spec, parallel, MegatronOptions(params_dtype="float32"))
        self.live: dict[str, torch.Tensor] = {}

    @property
    def world_size(self) -> int:
        return self.parallel.world_size

    def layouts(self) -> list[RankLayout]:
        return self.all

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.live

    def fill(self, checkpoint: str) -> None:
        values = materialize(self.all[self.rank], load_file(checkpoint))
        if not self.live:
            self.live.update(values)
            return
        with torch.no_grad():  # the optimizer step: new values, same storage
            for name, value in values.items():
                self.live[name].copy_(value)


def main(spec_path: str, result_path: str) -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from nemo_refit_reshard.integrations.vllm import plugin
    from nemo_refit_reshard.integrations.vllm.transfer_trainer import ReshardTrainerInitInfo

    spec = json.load(open(spec_path))
    r, fail_after = spec["rank"], spec.get("fail_after")
    result: dict[str, Any] = {"ok": False}
    source = MegatronShards(
        spec_from_hf_config(spec["config"], name="test"), TrainParallel.parse(spec["train"]), r
    )
    source.fill(spec["checkpoints"][0])
    client = PipeWeightSyncClient([tuple(a) for a in spec["workers"]], spec["authkey"].encode())
    try:
        plugin.register()
        info = ReshardTrainerInitInfo(
            rank=r,
            vllm_parallel=spec["vllm_parallel"],
            params_dtype="float32",
            port=spec["port"],
            secret=spec["secret"],
            timeout_s=60,
            # the workers join once vLLM has built their models: slow on a loaded machine
            connect_timeout_s=400,
            bucket_mb=1,
        )
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        result.update(engine=type(engine).__name__, fingerprint=engine.plan.fingerprint)
        for step, path in enumerate(spec["checkpoints"]):
            if fail_after is not None and step == fail_after:
                break
            source.fill(path)
            engine.send_weights(weight_version=f"v{step + 1}")
        if fail_after is not None:
            if r == 1:
                engine.shutdown()  # leaves the group: the next update cannot complete
            else:
                try:
                    engine.send_weights(weight_version=f"v{fail_after + 1}")
                    result["failed_update"] = None
                except Exception as err:
                    result["failed_update"] = f"{type(err).__name__}: {err}"[:400]
                result["status"] = client.call("status")
                try:
                    client.call("engine_finish")
                    result["engine_finish"] = None
                except RuntimeError as err:
                    result["engine_finish"] = str(err)[:600]
        if r == 0:
            client.call("close")
        if fail_after is None or r == 1:
            engine.shutdown()
        result["ok"] = True
    except BaseException as err:
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()
    finally:
        with open(result_path, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1)  # a hung rank's stacks: kill -USR1 <pid>
    main(sys.argv[1], sys.argv[2])
