"""A fresh vLLM process: does ``load_general_plugins()`` make ``backend="reshard"`` work?

    python -m tests.programs.vllm_plugin_check RESULT.json CONFIG.json

Nothing of ours is imported before vLLM's own plugin loader runs; the test puts the
package's entry-point metadata on the path (as ``pip install`` does).
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main(result_path: str, config_path: str) -> None:
    result: dict[str, Any] = {}
    import torch
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    result["loaded_ours"] = "nemo_refit_reshard.integrations.vllm.transfer_worker" in sys.modules
    from nemo_refit_reshard.integrations.vllm import plugin

    plugin.register()  # a second registration is harmless
    from tests.helpers import vllm_cpu

    model, config = vllm_cpu.build_model(
        json.load(open(config_path)), vllm_cpu.EngineRank(tp=2), "cpu", "float32"
    )
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="reshard"), config, torch.device("cpu"), model
    )
    result["engine"] = type(engine).__module__ + "." + type(engine).__name__
    result["trainer"] = WeightTransferTrainerFactory._registry["reshard"]().__name__
    try:
        WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="resharrd"), config, torch.device("cpu"), model
        )
    except ValueError as err:
        result["unknown"] = str(err)
    config.model_config.quantization = "fp8"  # refused when vLLM creates the engine
    try:
        WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="reshard"), config, torch.device("cpu"), model
        )
    except ValueError as err:
        result["quantized"] = f"{type(err).__name__}: {err}"
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
