"""One training rank in the vLLM worker test: Megatron-layout tensors of each step's
checkpoint, sent through the refit group (run with the project's Python).

    python -m tests.programs.train_refit_rank SPEC.json

SPEC: ``{"config", "train", "rank", "endpoint", "plan", "checkpoints"}``.
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import load_file

from nemo_refit_reshard.integrations.worker import RefitEndpoint, RefitWorker
from nemo_refit_reshard.layouts import MegatronOptions, megatron_layout
from nemo_refit_reshard.spec import TrainParallel, spec_from_hf_config
from tests.helpers.vllm_reference import materialize


def main(spec_path: str) -> None:
    spec = json.load(open(spec_path))
    model = spec_from_hf_config(spec["config"], name="test")
    layout = megatron_layout(
        model,
        TrainParallel.parse(spec["train"]),
        spec["rank"],
        MegatronOptions(params_dtype="float32"),
    )
    tensors = materialize(layout, load_file(spec["checkpoints"][0]))
    worker = RefitWorker(RefitEndpoint.from_json(spec["endpoint"]), tensors)
    worker.join()
    with open(spec["plan"].format(rank=spec["rank"])) as f:
        worker.load_plan(f.read())
    for step, path in enumerate(spec["checkpoints"]):
        if step:  # the optimizer step: new values, same storage
            with torch.no_grad():
                for name, value in materialize(layout, load_file(path)).items():
                    tensors[name].copy_(value)
        worker.refit()
    worker.close()


if __name__ == "__main__":
    main(sys.argv[1])
