"""A vLLM-native colocated ``trainer_init`` whose start fails (the client, standing in
for vLLM's ``VLLMWeightSyncClient``, refuses at once): the trainer's staging must be
released before the error reaches the caller (run with vLLM's Python: the trainer
engine imports vLLM's weight-transfer base classes).

    python -m tests.programs.colocated_start_fails RESULT.json

Records the error and the shared-memory segments this start created that are still
in ``/dev/shm`` after it (the project's ``nrr-…`` of this process, or any ``psm_…``,
the names of the code before #40.6).
"""

from __future__ import annotations

import json
import os
import sys

import torch


class RefusingClient:
    """Stands in for ``VLLMWeightSyncClient``: the workers refuse the engine."""

    def init_weight_transfer_engine(self, payload: dict) -> None:
        raise RuntimeError("the workers refused the engine")


def main() -> None:
    from nemo_refit_reshard.engine.rendezvous import free_address, new_secret
    from nemo_refit_reshard.integrations.vllm.transfer_sources import FullModuleSource
    from nemo_refit_reshard.integrations.vllm.transfer_trainer import (
        ReshardTrainerInitInfo,
        ReshardTrainerWeightTransferEngine,
    )
    from nemo_refit_reshard.spec import spec_from_hf_config
    from tests.helpers.hf_models import TINY_CONFIGS

    spec = spec_from_hf_config(dict(TINY_CONFIGS["qwen3"], torch_dtype="float32"))
    tensors = {t.name: torch.zeros(t.shape) for t in spec}
    source = FullModuleSource(tensors, spec, world_size=1, rank=0)
    info = ReshardTrainerInitInfo(
        rank=0, vllm_parallel={"tp": 1}, params_dtype="float32", port=free_address()[1],
        secret=new_secret(), timeout_s=30, connect_timeout_s=5, colocated=True,
    )  # fmt: skip
    before = set(os.listdir("/dev/shm"))
    mine = ("nrr-", f"-{os.getpid()}-")
    try:
        ReshardTrainerWeightTransferEngine.trainer_init(
            info, client=RefusingClient(), source=source
        )
        error = None
    except RuntimeError as err:
        error = str(err)
    left = sorted(
        n
        for n in set(os.listdir("/dev/shm")) - before
        if n.startswith("psm_") or (n.startswith(mine[0]) and mine[1] in n)
    )
    with open(sys.argv[1], "w") as f:
        json.dump({"error": error, "left": left}, f)
    sys.stdout.flush()
    os._exit(0)  # the group's join thread may still wait for the worker


if __name__ == "__main__":
    main()
