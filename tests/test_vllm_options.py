"""Engine options the vLLM adapter refuses, read from a vLLM config (no vLLM needed).

The config objects are plain namespaces carrying the attribute names of vLLM 0.33's
``VllmConfig`` (``model_config.quantization``, ``parallel_config.enable_eplb``, ...).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nemo_refit_reshard.integrations.vllm import UnsupportedVllmOption, engine_layout
from nemo_refit_reshard.spec import InferParallel


def config(**parallel: object) -> SimpleNamespace:
    par = dict(
        tensor_parallel_size=2,
        pipeline_parallel_size=1,
        data_parallel_size=2,
        enable_expert_parallel=True,
        all2all_backend="allgather_reducescatter",
        enable_eplb=False,
        eplb_config=SimpleNamespace(num_redundant_experts=0),
        expert_placement_strategy="linear",
        prefill_context_parallel_size=1,
        decode_context_parallel_size=1,
    )
    quant = parallel.pop("quantization", None)
    par.update(parallel)
    return SimpleNamespace(
        model_config=SimpleNamespace(quantization=quant, dtype="torch.bfloat16"),
        parallel_config=SimpleNamespace(**par),
    )


def test_engine_layout_reads_parallelism_and_options() -> None:
    lay = engine_layout(config(), "0.33.0")
    assert lay.parallel == InferParallel(tp=2, engine_dp=2, ep=4)
    assert lay.options.params_dtype == "bfloat16"
    assert lay.options.all2all_backend == "allgather_reducescatter"
    assert lay.options.sequence_parallel_moe(lay.parallel)


@pytest.mark.parametrize(
    "option, message",
    [
        (dict(quantization="fp8"), "quantization='fp8': quantized weights are re-packed"),
        (dict(enable_eplb=True), "enable_eplb=True: EPLB moves experts"),
        (
            dict(eplb_config=SimpleNamespace(num_redundant_experts=32)),
            "eplb_config.num_redundant_experts=32: set it to 0",
        ),
        (
            dict(expert_placement_strategy="round_robin"),
            "expert_placement_strategy='round_robin': only linear expert placement",
        ),
        (dict(prefill_context_parallel_size=2), "prefill_context_parallel_size=2: context"),
        (dict(decode_context_parallel_size=4), "decode_context_parallel_size=4: context"),
    ],
)
def test_unmodelled_options_are_refused(option: dict[str, object], message: str) -> None:
    with pytest.raises(UnsupportedVllmOption) as err:
        engine_layout(config(**option), "0.33.0")
    text = str(err.value)
    assert text.startswith("this vLLM engine uses options reshard refit does not support:\n  ")
    assert text.splitlines()[1].strip().startswith(message), text


def test_every_problem_is_listed() -> None:
    with pytest.raises(UnsupportedVllmOption) as err:
        engine_layout(config(quantization="awq", enable_eplb=True), "0.33.0")
    assert len(str(err.value).splitlines()) == 3


def test_unknown_release_is_refused() -> None:
    with pytest.raises(ValueError, match=r"vLLM 0\.2\.0 is not a release"):
        engine_layout(config(), "0.2.0")


def test_block_fp8_engine_is_served() -> None:
    """``quantization='fp8'`` with the checkpoint's ``weight_block_size``: a block-FP8
    engine (refit through BF16 twins, quantized by the worker); without a block size
    (per-tensor FP8) it stays refused."""
    cfg = config(quantization="fp8")
    cfg.model_config.hf_config = SimpleNamespace(
        quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}
    )
    assert engine_layout(cfg, "0.33.0").fp8_block == (128, 128)
    assert engine_layout(config(), "0.33.0").fp8_block is None
