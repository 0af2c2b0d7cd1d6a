"""RL-style refit through vLLM's own weight-transfer API with the ``reshard`` backend.

A Megatron-core trainer (tp=2, two Ray actors) refits a vLLM ``LLM`` (tp=2, a Ray
actor) the way vLLM's RL examples are written: the engine is started with
``WeightTransferConfig(backend="reshard")`` (found through this package's
``vllm.general_plugins`` entry point), every trainer rank builds the trainer engine with
``WeightTransferTrainerFactory.trainer_init`` and calls ``send_weights()`` per sync;
rank 0 drives the engine through vLLM's ``RayVLLMWeightSyncClient``.

    python examples/vllm/rl_reshard.py --model Qwen/Qwen3-0.6B [--transport cupy-nccl]

Needs 4 GPUs (2 trainer, 2 vLLM). Not run in this repository's CI (no GPU there); the
same engines are tested on CPU in tests/test_vllm_weight_transfer.py.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import ray
import torch


@ray.remote(num_gpus=1)
class TrainerRank:
    """One Megatron-core tensor-parallel rank holding its local shards, loaded from the
    model's HF checkpoint (so generation stays sensible across the small updates)."""

    def __init__(self, rank: int, world: int, master: str, model_id: str) -> None:
        host, port = master.rsplit(":", 1)
        os.environ.update(MASTER_ADDR=host, MASTER_PORT=port)
        torch.distributed.init_process_group("nccl", rank=rank, world_size=world)
        torch.cuda.set_device(0)  # Ray gives each rank one GPU, visible as device 0
        from huggingface_hub import snapshot_download
        from megatron.core import parallel_state as ps
        from safetensors.torch import load_file
        from transformers import AutoConfig

        from nemo_refit_reshard.integrations.megatron import load_canonical, megatron_live_tensors
        from nemo_refit_reshard.integrations.megatron.cpu import build_gpt, transformer_config
        from nemo_refit_reshard.layouts import (
            MegatronOptions,
            megatron_layout,
            megatron_padded_vocab,
        )
        from nemo_refit_reshard.spec import TrainParallel, spec_from_hf_config

        ps.initialize_model_parallel(tensor_model_parallel_size=world)
        hf = AutoConfig.from_pretrained(model_id).to_dict()
        self.spec = spec_from_hf_config(hf, name=model_id)
        self.parallel, self.rank = TrainParallel(tp=world), rank
        config = transformer_config(self.spec.arch, self.parallel, norm_eps=hf["rms_norm_eps"])
        vocab = megatron_padded_vocab(self.spec.arch.vocab_size, world)
        rope = (hf.get("rope_parameters") or {}).get("rope_theta") or hf.get("rope_theta")
        self.model = build_gpt(config, self.spec.arch, self.parallel, vocab, rope_theta=rope)
        layout = megatron_layout(
            self.spec, self.parallel, rank, MegatronOptions(params_dtype="float32")
        )
        checkpoint = {}
        for path in sorted(Path(snapshot_download(model_id)).glob("*.safetensors")):
            checkpoint.update(load_file(str(path)))
        load_canonical(megatron_live_tensors(self.model), layout, checkpoint)
        for chunk in self.model:
            chunk.cuda()

    def init_transfer(self, llm: ray.actor.ActorHandle, port: int, secret: str, transport: str):
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from nemo_refit_reshard.integrations.vllm import plugin
        from nemo_refit_reshard.integrations.vllm.transfer_sources import MegatronSource
        from nemo_refit_reshard.integrations.vllm.transfer_trainer import ReshardTrainerInitInfo

        plugin.register()  # the trainer is not a vLLM process: its plugins are not loaded
        info = ReshardTrainerInitInfo(
            rank=self.rank,
            vllm_parallel={"tp": 2},
            params_dtype="bfloat16",  # vLLM's; senders cast their float32 shards on packing
            host=ray.util.get_node_ip_address(),
            port=port,
            secret=secret,
            transport=transport,
        )
        source = MegatronSource(self.model, self.spec, self.parallel, self.rank)
        client = RayVLLMWeightSyncClient(llm)
        self.sender = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)

    def train_step_and_sync(self, step: int) -> None:
        with torch.no_grad():  # stands in for an optimizer step: new values, same storage
            for chunk in self.model:
                for p in chunk.parameters():
                    p.add_(1e-3)
        self.sender.send_weights(weight_version=f"step-{step}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="Qwen/Qwen3-0.6B")
    parser.add_argument("--transport", default="gloo", choices=["gloo", "cupy-nccl"])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig

    from nemo_refit_reshard.engine.rendezvous import free_address, new_rendezvous

    ray.init()
    llm = ray.remote(num_gpus=0)(LLM).remote(  # its two workers take the GPUs
        model=args.model,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        weight_transfer_config=WeightTransferConfig(backend="reshard"),
    )
    host = ray.util.get_node_ip_address()
    meet = new_rendezvous(host)  # the refit group's, hosted by trainer rank 0
    _, master_port = free_address(host)  # the trainers' own torch.distributed world
    trainers = [TrainerRank.remote(r, 2, f"{host}:{master_port}", args.model) for r in range(2)]
    ray.get([t.init_transfer.remote(llm, meet.port, meet.secret, args.transport) for t in trainers])
    for step in range(args.steps):
        ray.get([t.train_step_and_sync.remote(step) for t in trainers])
        out = ray.get(
            llm.generate.remote(["The capital of France is"], SamplingParams(max_tokens=8))
        )
        print(step, out[0].outputs[0].text)


if __name__ == "__main__":
    main()
