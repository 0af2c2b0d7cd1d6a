"""Device check: refit a real ``vllm.LLM`` on one GPU and compare it with HF transformers.

    python benchmarks/gpu_vllm_check.py            # needs CUDA and a GPU install of vLLM

For a small random-initialised Qwen3 and Qwen3-MoE (from a config, no download):

1. start ``vllm.LLM`` (TP=1, dummy weights, ``worker_extension_cls`` =
   :class:`ReshardWorkerExtension`) and record every parameter's storage pointer;
2. a training process (CPU, Megatron-layout shards of the HF model's weights) refits
   it over the gloo transport; the vLLM worker stages through pinned host memory;
3. greedy tokens and logprobs of vLLM must equal HF transformers' on the same
   weights, and no parameter storage may have moved (CUDA graphs stay valid).

Prints one table row per model and exits non-zero if any check fails. Without
CUDA it says so in one line and exits 2. Budget: under 5 minutes on one H200.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from typing import Any

import torch

_SHAPE = dict(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
MODELS: dict[str, dict[str, Any]] = {
    "qwen3": dict(_SHAPE, architectures=["Qwen3ForCausalLM"], model_type="qwen3"),
    "qwen3_moe": dict(
        _SHAPE,
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
}
PROMPTS = [[1, 17, 42, 99, 5], [7, 7, 300, 12, 640, 3, 8]]
MAX_TOKENS = 16


def hf_model(cfg: dict[str, Any]) -> torch.nn.Module:
    import transformers

    rest = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    config = transformers.AutoConfig.for_model(cfg["model_type"], **rest)
    config.architectures = cfg["architectures"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    return model


def train_rank(cfg: dict[str, Any], canonical_path: str, endpoint_json: str, plan: str) -> None:
    from safetensors.torch import load_file

    from nemo_refit_reshard.engine.materialize import materialize
    from nemo_refit_reshard.integrations.worker import RefitEndpoint, RefitWorker
    from nemo_refit_reshard.layouts import MegatronOptions, megatron_layout
    from nemo_refit_reshard.spec import TrainParallel, spec_from_hf_config

    spec = spec_from_hf_config(cfg)
    layout = megatron_layout(spec, TrainParallel(), 0, MegatronOptions(params_dtype="float32"))
    tensors = materialize(layout, load_file(canonical_path))
    worker = RefitWorker(RefitEndpoint.from_json(endpoint_json), tensors)
    worker.join()
    worker.load_plan(plan)
    worker.refit()
    worker.close()


def pointers(worker: Any) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in worker.model_runner.model.named_parameters()}


def check(name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    from nemo_refit_reshard.engine.rendezvous import free_port
    from nemo_refit_reshard.integrations.worker import RefitEndpoint
    from nemo_refit_reshard.layouts import (
        MegatronOptions,
        VllmOptions,
        megatron_layout,
        vllm_layouts,
    )
    from nemo_refit_reshard.plan import plan_refit
    from nemo_refit_reshard.spec import InferParallel, TrainParallel, spec_from_hf_config

    work = tempfile.mkdtemp(prefix=f"gpu-vllm-{name}-")
    hf = hf_model(cfg)
    # The checkpoint as written to disk: per-expert keys are the canonical names.
    hf.save_pretrained(work)
    canonical_path = os.path.join(work, "model.safetensors")
    with open(os.path.join(work, "config.json")) as f:
        cfg = json.load(f)
    assert set(load_file(canonical_path)) == {t.name for t in spec_from_hf_config(cfg)}

    spec = spec_from_hf_config(cfg)
    import vllm

    opts = VllmOptions(params_dtype="float32", vllm_version=vllm.__version__)
    src = [megatron_layout(spec, TrainParallel(), 0, MegatronOptions(params_dtype="float32"))]
    plan = plan_refit(spec, src, vllm_layouts(spec, InferParallel(), opts)).to_json()

    llm = LLM(
        model=work,
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype="float32",
        gpu_memory_utilization=0.3,
        max_model_len=256,
        worker_extension_cls="nemo_refit_reshard.integrations.vllm.ReshardWorkerExtension",
    )
    before = llm.collective_rpc(pointers)[0]
    endpoint = RefitEndpoint("127.0.0.1", free_port(), 2, 0, "gloo", timeout_s=300)
    ctx = mp.get_context("spawn")
    trainer = ctx.Process(target=train_rank, args=(cfg, canonical_path, endpoint.to_json(), plan))
    trainer.start()
    llm.collective_rpc("refit_join", args=(endpoint.to_json(), 1))
    llm.collective_rpc("refit_load_plan", args=(plan,))
    t0 = time.perf_counter()
    timing = llm.collective_rpc("refit_step")[0]
    refit_s = time.perf_counter() - t0
    trainer.join()
    llm.reset_prefix_cache()
    after = llm.collective_rpc(pointers)[0]

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    hf = hf.cuda()
    token_match, max_dlogp = True, 0.0
    for prompt, out in zip(PROMPTS, outs):
        got = list(out.outputs[0].token_ids)
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt], device="cuda"),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        want = ref.sequences[0, len(prompt) :].tolist()
        token_match &= got == want
        for step, tok in enumerate(got[: len(want)]):
            hf_lp = torch.log_softmax(ref.scores[step][0].float(), -1)[want[step]].item()
            vllm_lp = out.outputs[0].logprobs[step][tok].logprob
            max_dlogp = max(max_dlogp, abs(hf_lp - vllm_lp))
    llm.collective_rpc("refit_close")
    return dict(
        model=name,
        tokens_equal=token_match,
        max_abs_dlogprob=max_dlogp,
        pointers_unchanged=before == after,
        refit_s=refit_s,
        staging_share=timing["staging_seconds"] / max(timing["seconds"], 1e-9),
        ok=token_match and max_dlogp < 1e-3 and before == after,
    )


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_vllm_check: needs a CUDA GPU and a GPU install of vLLM (pip install -e .[vllm])")
        return 2
    # collective_rpc with a callable (the pointer probe) ships it with cloudpickle.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    rows = [check(name, cfg) for name, cfg in MODELS.items()]
    print(
        f"{'model':<10} {'tokens equal':>12} {'max|dlogp|':>11} {'ptrs same':>9} "
        f"{'refit s':>8} {'staging/refit':>13}"
    )
    for r in rows:
        print(
            f"{r['model']:<10} {str(r['tokens_equal']):>12} {r['max_abs_dlogprob']:>11.2e} "
            f"{str(r['pointers_unchanged']):>9} {r['refit_s']:>8.3f} {r['staging_share']:>13.2f}"
        )
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
