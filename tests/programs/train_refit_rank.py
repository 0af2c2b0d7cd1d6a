"""One training rank in the vLLM worker test: a real megatron-core ``GPTModel`` shard
whose weights are placed by Megatron's own sharded state dict, sent through the refit
group (run with the project's Python).

    python -m tests.programs.train_refit_rank SPEC.json

SPEC: ``{"config", "train", "rank", "endpoint", "plan", "checkpoints", "init_file"}``.

The model is built on CPU over a gloo group of the training ranks (``init_file``) and
filled, at every step, through ``megatron_cpu.load_hf_through_sharded_state_dict``:
Megatron's ``sharded_state_dict()`` says where each local tensor sits in its global
tensor, never this project's layout. So a wrong Megatron rule in the layout provider
sends the wrong elements and the vLLM ranks' bit-exact check fails
(``test_vllm_worker.py::test_broken_megatron_rule_fails_the_refit``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from safetensors.torch import load_file

from nemo_refit_reshard.integrations.megatron import match_layout, megatron_live_tensors
from nemo_refit_reshard.integrations.worker import RefitEndpoint, RefitWorker
from nemo_refit_reshard.layouts import MegatronOptions, megatron_layout
from nemo_refit_reshard.spec import ModelSpec, TrainParallel, spec_from_hf_config


def build(
    hf: dict[str, Any], spec: ModelSpec, par: TrainParallel, rank: int, init_file: str
) -> tuple[list[torch.nn.Module], int]:
    """This rank's Megatron model chunks (GQA or MLA) and the padded vocabulary."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.helpers import megatron_cpu as mc

    mc.apply_cpu_patches()
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=par.world_size
    )
    ps.initialize_model_parallel(
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.expert_tp,
    )
    model_parallel_cuda_manual_seed(1234)
    vocab = mc.padded_vocab(spec.arch.vocab_size, par.tp)
    if spec.arch.mla is None:
        return mc.build_gpt(hf, spec, par, vocab), vocab
    from tests.helpers import megatron_mla_cpu as mla

    attn_cls = mla.cpu_mla_patches()
    mc.megatron_global = mla.mla_global  # the sharded keys of MLA layers
    return [mla.build_mla_gpt(hf, spec, par, vocab, attn_cls)], vocab


def main(spec_path: str) -> None:
    from tests.helpers import megatron_cpu as mc

    spec = json.load(open(spec_path))
    model = spec_from_hf_config(spec["config"], name="test").unquantized()
    par, rank = TrainParallel.parse(spec["train"]), spec["rank"]
    chunks, vocab = build(spec["config"], model, par, rank, spec["init_file"])
    layout = megatron_layout(model, par, rank, MegatronOptions(params_dtype="float32"))
    tensors = match_layout(megatron_live_tensors(chunks), layout)

    def load(path: str) -> None:
        """The optimizer step's stand-in: new values in the same storage."""
        mc.load_hf_through_sharded_state_dict(chunks, 1, model.arch, load_file(path), vocab)

    load(spec["checkpoints"][0])
    worker = RefitWorker(RefitEndpoint.from_json(spec["endpoint"]), tensors)
    worker.join()
    with open(spec["plan"].format(rank=rank)) as f:
        worker.load_plan(f.read())
    for step, path in enumerate(spec["checkpoints"]):
        if step:
            load(path)
        worker.refit()
    worker.close()


if __name__ == "__main__":
    main(sys.argv[1])
