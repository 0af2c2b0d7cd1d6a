"""A fresh vLLM process: does ``load_general_plugins()`` make ``backend="reshard"`` work?

    python -m tests.programs.vllm_plugin_check RESULT.json CONFIG.json

Nothing of ours is imported before vLLM's own plugin loader runs; it finds the entry point
in the metadata ``pip install`` wrote for this package.
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
    # vLLM's loader imported our plugin module (found through the installed metadata);
    # the engines themselves load lazily, on first use.
    result["plugin_loaded_by_vllm"] = "nemo_refit_reshard.integrations.vllm.plugin" in sys.modules
    result["engine_loaded_early"] = "nemo_refit_reshard.integrations.vllm.transfer_worker" in (
        sys.modules
    )
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
    import importlib

    importlib.reload(plugin)  # as if another package had registered "reshard" first
    try:
        plugin.register()
    except ValueError as err:
        result["conflict"] = str(err)
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
