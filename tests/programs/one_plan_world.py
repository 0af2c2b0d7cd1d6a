"""Two trainer ranks of a DeepSeek-V3-shaped megatron-core model whose first pipeline
stage is all dense, through every planning path (run with vLLM's Python: the trainer
engine imports vLLM's weight-transfer base classes).

    python -m tests.programs.one_plan_world RESULT.json

The model (MLA, 4 layers, ``first_k_dense_replace=2``, pp=2: stage 0 holds layers 0-1,
dense; stage 1 layers 2-3, MoE) is megatron-core's own ``GPTModel`` built on CPU from a
``TransformerConfig`` with ``moe_grouped_gemm=True`` (DeepSeek-V3's training setting),
so its experts are megatron-core's ``TEGroupedMLP``. **Stand-in**: Transformer Engine's
grouped linear layers (CUDA GEMM kernels) are replaced by modules holding the same
parameters (``weight0 .. weight{n-1}``, TE's names and shapes); nothing runs forward.

Each rank records:

* ``report``: what NeMo RL's policy worker (our mixin) reports to the driver;
* ``fingerprints``: the vLLM-native trainer's plan (``build_plan``), separate and
  colocated;
* ``separate`` / ``colocated``: a full ``trainer_init`` + ``send_weights`` of the
  vLLM-native trainer engine; rank 0's client stands in for vLLM's
  ``VLLMWeightSyncClient`` and runs the two workers' side with the framework-neutral
  workers our vLLM engine uses (``RefitWorker`` / ``ColocatedWorker``, in threads): each
  worker's tensors after the step must equal the checkpoint through its layout;
* ``divergent``: ``trainer_init`` where rank 1 states another bucket size: refused on
  both ranks before the client is called.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import traceback
import warnings
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

HF_OVERRIDES = dict(num_hidden_layers=4, first_k_dense_replace=2)
WORLD, SEED = 2, 7


def hf_config() -> dict[str, Any]:
    from tests.helpers.hf_models import TINY_CONFIGS

    return dict(TINY_CONFIGS["deepseek_v3"], **HF_OVERRIDES)


def canonical(spec: Any) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    return {t.name: torch.randn(t.shape, generator=gen) for t in spec}


class _GroupedLinear(torch.nn.Module):
    """Stand-in for TE's ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``:
    one ``weight{i}`` per local expert, sharded over the expert tensor-parallel ranks."""

    column = True

    def __init__(self, num_gemms: int, input_size: int, output_size: int, **kw: Any) -> None:
        super().__init__()
        etp = kw["pg_collection"].expt_tp.size()
        out, inp = (output_size // etp, input_size) if self.column else (
            output_size, input_size // etp
        )  # fmt: skip
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.zeros(out, inp)))


class _GroupedRow(_GroupedLinear):
    column = False


def _grouped_modules(self: Any, grouped: bool, legacy: bool) -> tuple:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

    if grouped:
        return TEGroupedMLP, MLPSubmodules(linear_fc1=_GroupedLinear, linear_fc2=_GroupedRow)
    return SequentialMLP, MLPSubmodules(
        linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
    )


def build_model(par: Any, spec: Any) -> torch.nn.Module:
    from megatron.core import parallel_state as ps
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from tests.helpers import megatron_cpu as mc
    from tests.helpers import megatron_mla_cpu as mla

    attn = mla.cpu_mla_patches()
    LocalSpecProvider.grouped_mlp_modules = _grouped_modules  # the TE stand-in above
    hf = hf_config()
    cfg = replace(
        mla.mla_config(hf, par), moe_grouped_gemm=True, pipeline_model_parallel_size=par.pp
    )
    block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    for layer_spec in block.layer_specs:
        layer_spec.submodules.self_attention.submodules.core_attention = attn
    return GPTModel(
        config=cfg,
        transformer_layer_spec=block,
        vocab_size=mc.padded_vocab(spec.arch.vocab_size, par.tp),
        max_sequence_length=64,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        position_embedding_type="rope",
        rotary_base=mc.rope_theta(hf),
        share_embeddings_and_output_weights=spec.arch.tie_word_embeddings,
    ).eval()


class WorkersClient:
    """Stands in for vLLM's ``VLLMWeightSyncClient`` and the engine's two workers: the
    init RPC starts each worker (``RefitWorker`` joining the group, or ``ColocatedWorker``
    connecting to its host) in a thread, as vLLM's ``collective_rpc`` would."""

    def __init__(self, spec: Any, infer: Any) -> None:
        from nemo_refit_reshard.layouts import VllmOptions, vllm_layouts

        self.layouts = vllm_layouts(spec, infer, VllmOptions(params_dtype="float32"))
        self.tensors = [
            {t.name: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for t in lay.tensors}
            for lay in self.layouts
        ]
        self.calls: list[str] = []
        self.workers: list[Any] = []

    def _each(self, fn: Any) -> None:
        errors: list[BaseException] = []

        def run(d: int) -> None:
            try:
                fn(d)
            except BaseException as err:  # noqa: BLE001 - re-raised below
                errors.append(err)

        threads = [threading.Thread(target=run, args=(d,)) for d in range(len(self.tensors))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def init_weight_transfer_engine(self, payload: dict[str, Any]) -> None:
        from nemo_refit_reshard.integrations.vllm.transfer_worker import (
            ReshardInitInfo,
            ReshardWeightTransferEngine,
        )
        from nemo_refit_reshard.integrations.worker import (
            ColocatedWorker,
            RefitEndpoint,
            RefitWorker,
        )

        self.calls.append("init")
        info = ReshardInitInfo(**payload)
        endpoint = RefitEndpoint.from_json(info.endpoint)
        first = info.first_rank
        self.workers = [None] * len(self.tensors)

        def slice_of(rank: int) -> str:
            # As our vLLM worker engine gets it: shipped, or read from the group's store.
            if isinstance(info.plan, dict):
                return info.plan[str(rank)]
            plan = ReshardWeightTransferEngine._plan_of(info, rank)
            return plan[str(rank)] if isinstance(plan, dict) else plan

        def start(d: int) -> None:
            if info.colocated:
                w = ColocatedWorker(self.tensors[d])
                w.connect(info.colocated[d], endpoint.secret, slice_of(first + d), first + d,
                          endpoint.timeout_s)  # fmt: skip
            else:
                w = RefitWorker(replace(endpoint, group_rank=first + d), self.tensors[d])
                w.join()  # the real worker joins first: rank 0 publishes once all have
                w.load_plan(slice_of(first + d))
            self.workers[d] = w

        self._each(start)

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update: dict[str, Any]) -> None:
        self.calls.append("update")
        self._each(lambda d: self.workers[d].refit(update["step"]))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")

    def close(self) -> None:
        for w in self.workers:
            if w is not None:
                w.close()

    def mismatches(self, checkpoint: dict[str, torch.Tensor]) -> list[str]:
        from nemo_refit_reshard.integrations.megatron import load_canonical

        bad = []
        for d, lay in enumerate(self.layouts):
            want = {n: torch.empty_like(t) for n, t in self.tensors[d].items()}
            load_canonical(want, lay, checkpoint)
            bad += [
                f"worker {d}: {n}" for n in want if not torch.equal(want[n], self.tensors[d][n])
            ]
        return bad


def _trainer_run(
    rank: int, model: Any, spec: Any, par: Any, port: int, secret: str, **info_kw: Any
) -> dict[str, Any]:
    """``trainer_init`` + one ``send_weights`` of the vLLM-native trainer engine."""
    from nemo_refit_reshard.integrations.vllm.transfer_sources import MegatronSource
    from nemo_refit_reshard.integrations.vllm.transfer_trainer import (
        ReshardTrainerInitInfo,
        ReshardTrainerWeightTransferEngine,
    )
    from nemo_refit_reshard.spec import InferParallel

    infer = InferParallel(tp=2)
    client = WorkersClient(spec, infer) if rank == 0 else None
    info = ReshardTrainerInitInfo(
        rank=rank, vllm_parallel={"tp": 2}, params_dtype="float32",
        port=port, secret=secret, timeout_s=120, **info_kw,
    )  # fmt: skip
    out: dict[str, Any] = {}
    try:
        source = MegatronSource(model, spec, par, rank)
        engine = ReshardTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
        out["fingerprint"] = engine.plan.fingerprint
        engine.send_weights()
        if client is not None:
            out["mismatches"] = client.mismatches(canonical(spec))
            out["checked"] = sum(len(t) for t in client.tensors)
        engine.shutdown()
    except Exception as err:  # noqa: BLE001 - recorded for the test
        out["error"] = f"{type(err).__name__}: {err}"
    finally:
        if client is not None:
            out["calls"] = client.calls
            client.close()
    return out


def worker(rank: int, tmp: str) -> None:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nemo_refit_reshard.engine.rendezvous import broadcast_text, free_address, new_secret
    from nemo_refit_reshard.integrations.megatron import (
        load_canonical,
        megatron_live_tensors,
    )
    from nemo_refit_reshard.integrations.nemo_rl.policy_worker import ReshardPolicyWorkerMixin
    from nemo_refit_reshard.integrations.vllm.transfer_sources import MegatronSource
    from nemo_refit_reshard.integrations.vllm.transfer_trainer import (
        ReshardTrainerInitInfo,
        build_plan,
    )
    from nemo_refit_reshard.spec.model import spec_from_hf_config
    from nemo_refit_reshard.spec.parallel import TrainParallel
    from tests.helpers import megatron_cpu as mc

    torch.set_num_threads(1)
    mc.apply_cpu_patches()
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=300),
    )  # fmt: skip
    par = TrainParallel(pp=2)
    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    spec = spec_from_hf_config(hf_config())
    model = build_model(par, spec)
    out: dict[str, Any] = {}
    policy = ReshardPolicyWorkerMixin()
    policy.model, policy.rank = model, rank
    out["report"] = policy.reshard_describe()
    try:
        source = MegatronSource(model, spec, par, rank)
        load_canonical(
            megatron_live_tensors(model), source.layouts()[rank], canonical(spec)
        )  # the trainer's weights: the checkpoint through its layout
        out["fingerprints"] = {
            mode: build_plan(
                ReshardTrainerInitInfo(
                    rank=rank,
                    vllm_parallel={"tp": 2},
                    params_dtype="float32",
                    colocated=mode == "colocated",
                ),  # fmt: skip
                source,
            ).fingerprint
            for mode in ("separate", "colocated")
        }
    except Exception as err:  # noqa: BLE001 - recorded for the test
        out["source_error"] = f"{type(err).__name__}: {err}"
    for mode, kw in [
        ("separate", {}),
        ("colocated", {"colocated": True}),
        ("divergent", {"colocated": True, "bucket_mb": 512 if rank == 0 else 1}),
    ]:
        address = broadcast_text(f"{free_address()[1]}:{new_secret()}")
        port, secret = address.split(":")
        out[mode] = _trainer_run(rank, model, spec, par, int(port), secret, **kw)
        dist.barrier()
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    result_path = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(worker, args=(tmp,), nprocs=WORLD, start_method="spawn")
        except Exception:
            traceback.print_exc()
            raise
        results = []
        for r in range(WORLD):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                results.append(json.load(f))
    with open(result_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
