"""Bytes per refit of NeMo RL's three refit routes, on the overlays' configurations.

    python benchmarks/nemo_rl_routes.py

Pure planning (no processes), bf16 both sides, the Megatron layouts of NeMo RL's
Megatron-Bridge models (TE layer spec, grouped GEMM for MoE):

- **gather** — what the policy side must receive so that every rank holds every full
  tensor: sum over policy ranks of (model bytes - the distinct canonical elements the
  rank already holds). NeMo RL's default refit and the drop-in checkpoint engine both
  start from that (Megatron-Bridge's export: PP broadcast + TP/EP gathers); this is its
  lower bound. The full reshard sends from the local shards: 0.
- **wire** — what crosses from the policy to the vLLM GPUs. Default: every full tensor
  broadcast to every vLLM GPU. Drop-in: our plan from ranks holding every tensor. Full
  reshard: our plan from the Megatron layouts. The minimum is what the vLLM GPUs store.
"""

from __future__ import annotations

import time

import torch

from nemo_refit_reshard.engine.program import TORCH_DTYPES
from nemo_refit_reshard.integrations.checkpoint_engine import replicated_layout
from nemo_refit_reshard.layouts import MegatronOptions, VllmOptions, megatron_layout, vllm_layouts
from nemo_refit_reshard.layouts.base import RankLayout
from nemo_refit_reshard.plan import plan_refit
from nemo_refit_reshard.spec import InferParallel, TrainParallel, load_model_spec
from nemo_refit_reshard.spec.model import ModelSpec

# configs/nemo_rl overlays: (name, model, Megatron on the training GPUs, vLLM)
CASES = [
    ("grpo_math_qwen3_8B_megatron_reshard", "qwen3-8b", "tp=2,pp=2,dp=2", "tp=2,dp=4"),
    (
        "grpo_math_qwen30ba3b_megatron_reshard",
        "qwen3-30b-a3b",
        "tp=2,dp=24,ep=8,etp=1",
        "tp=4,dp=2,engine_dp=2,ep=8",
    ),
]


def held_bytes(spec: ModelSpec, layout: RankLayout) -> int:
    """Bytes of distinct canonical elements one rank holds (pieces never overlap on a
    rank except through replication inside a fused tensor, which we count once)."""
    seen: dict[str, set[tuple]] = {}
    total = 0
    sizes = {t.name: itemsize(t.dtype) for t in spec}
    for t in layout.tensors:
        for p in t.pieces:
            key = tuple(p.canonical_box.offsets) + tuple(p.canonical_box.sizes)
            if key in seen.setdefault(p.canonical, set()):
                continue
            seen[p.canonical].add(key)
            total += p.canonical_box.numel * sizes[p.canonical]
    return total


def main() -> None:
    print("| overlay | route | gather (policy side) | wire (to vLLM) | wire / minimum |")
    print("|---|---|---|---|---|")
    for name, model, train_text, infer_text in CASES:
        t0 = time.perf_counter()
        spec = load_model_spec(model)
        train, infer = TrainParallel.parse(train_text), InferParallel.parse(infer_text)
        opts = MegatronOptions(layer_spec="te", moe_grouped_gemm=spec.arch.moe is not None)
        sources = [megatron_layout(spec, train, r, opts) for r in range(train.world_size)]
        destinations = vllm_layouts(spec, infer, VllmOptions())
        model_bytes = sum(t.numel * itemsize(t.dtype) for t in spec)
        gather = sum(model_bytes - held_bytes(spec, s) for s in sources)
        full = plan_refit(spec, sources, destinations)
        floor = full.stats.min_bytes
        replicated = [
            replicated_layout(spec, train.world_size, r, None) for r in range(train.world_size)
        ]
        dropin = plan_refit(spec, replicated, destinations)
        broadcast = model_bytes * infer.world_size
        rows = [
            ("NeMo RL default (`nccl`)", gather, broadcast),
            ("drop-in checkpoint engine", gather, dropin.stats.total_bytes),
            ("full reshard (`reshard`)", 0, full.stats.total_bytes),
        ]
        for route, g, w in rows:
            print(f"| {name} | {route} | {gib(g)} | {gib(w)} | {w / floor:.2f}x |")
        print(f"<!-- {name}: {train} -> {infer}, planned in {time.perf_counter() - t0:.0f} s -->")


def itemsize(dtype: str) -> int:
    return torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()


def gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


if __name__ == "__main__":
    main()
