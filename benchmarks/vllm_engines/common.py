"""What every engine's figures read: one case built once, and the figures' shape."""

from __future__ import annotations

import copy
import re
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from nemo_refit_reshard.layouts import RankLayout
    from nemo_refit_reshard.plan import RefitPlan
    from nemo_refit_reshard.spec import CanonicalTensor, InferParallel

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)
Held = dict[str, list[Box]]  # canonical name -> distinct boxes one training rank holds


@dataclass
class Figures:
    """One engine's figures for one case (bytes). ``None``: not obtainable on CPU.

    ``worker_max`` / ``worker_total``: bytes one vLLM worker receives in one refit (the
    most any worker does / the sum over all workers). ``trainer_gather``: bytes the
    training ranks move among themselves before they can serve, summed over training
    ranks. ``worker_staging`` / ``trainer_staging``: transfer buffers one rank holds at
    once, worker side / trainer side."""

    worker_max: int
    worker_total: int
    trainer_gather: int | None
    worker_staging: int | None
    trainer_staging: int | None
    notes: list[str] = field(default_factory=list)
    whole: frozenset[str] = frozenset()  # nccl_m2n: names some worker receives whole


# ---------------------------------------------------------------------------------------
# Names: every checkpoint name, and the representative layer vLLM is built with.

_LAYER = re.compile(r"^(model\.layers\.)(\d+)(\..*)$")


def kept_layers(hf_config: dict) -> int:
    """Layers vLLM's model is built with: one per kind (DeepSeek: dense ones, then 1 MoE)."""
    return int(hf_config.get("first_k_dense_replace", 0) or 0) + 1


def representative(name: str, keep: int) -> str:
    """The name ``name`` is counted as in a model built with ``keep`` layers: layer ``L``
    at or past the last kept layer is that last layer."""
    m = _LAYER.match(name)
    if m is None or int(m.group(2)) < keep:
        return name
    return f"{m.group(1)}{keep - 1}{m.group(3)}"


_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


def truncated_config(hf_config: dict) -> dict:
    """The preset's config.json with one layer per kind, transformers' defaults filled."""
    import transformers

    cfg = copy.deepcopy(hf_config)
    cfg["num_hidden_layers"] = kept_layers(hf_config)
    cfg.pop("num_nextn_predict_layers", None)  # MTP layers: not in vLLM's main model
    model_type = cfg.pop("model_type", None) or _MODEL_TYPES[cfg["architectures"][0]]
    full = transformers.AutoConfig.for_model(model_type, **cfg).to_dict()
    full["architectures"] = cfg["architectures"]
    return full


# ---------------------------------------------------------------------------------------
# Training side: what each Megatron rank holds of each checkpoint tensor.


def held_boxes(sources: list[RankLayout]) -> list[Held]:
    """Per training rank: canonical name -> distinct boxes it holds."""
    out = []
    for layout in sources:
        boxes: dict[str, set] = defaultdict(set)
        for t in layout.tensors:
            for p in t.pieces:
                b = p.canonical_box
                boxes[p.canonical].add((tuple(b.offsets), tuple(b.sizes)))
        out.append({k: sorted(v) for k, v in boxes.items()})
    return out


def overlap(box: Box, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    """Elements ``box`` shares with the box at ``offsets`` of ``sizes``."""
    n = 1
    for o, s, bo, bs in zip(box[0], box[1], offsets, sizes):
        lo, hi = max(o, bo), min(o + s, bo + bs)
        if hi <= lo:
            return 0
        n *= hi - lo
    return n


def held_numel(boxes: list[Box], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> int:
    """Elements of the box at ``offsets`` of ``sizes`` that ``boxes`` (distinct) hold."""
    return sum(overlap(b, offsets, sizes) for b in boxes)


# ---------------------------------------------------------------------------------------
# One case, built once.


@dataclass
class Case:
    """A model, Megatron's layout, vLLM's layout: our plan (full depth, all ranks) and
    what every engine reads of it. ``tensors``: the checkpoint tensors vLLM's main model
    stores (``dropped``: the rest, DeepSeek-V3's MTP layer); ``rep``: each one's name in
    vLLM's model built with ``keep`` layers (``small``: that model's config), and
    ``rnames`` / ``rdtypes`` / ``rshapes``: one entry per representative name."""

    plan: RefitPlan
    infer: InferParallel
    num_sources: int  # T: training ranks
    num_workers: int  # N: vLLM workers
    held: list[Held]
    tensors: list[CanonicalTensor]
    dropped: list[str]
    dtype: dict[str, torch.dtype]
    nbytes: dict[str, int]
    keep: int
    small: dict[str, Any]
    rep: dict[str, str]
    rnames: list[str]
    rdtypes: list[torch.dtype]
    rshapes: list[tuple[int, ...]]
    plan_seconds: float  # building our layouts and plan

    @property
    def model_bytes(self) -> int:
        return sum(self.nbytes.values())

    @property
    def replicas(self) -> int:
        """vLLM's inference replicas: workers per TP position."""
        return self.num_workers // self.infer.tp


def build_case(
    model_name: str, train_text: str, infer_text: str, stages: tuple[int, int] | None
) -> Case:
    """Our layouts and plan for the case, and the names, dtypes and sizes of its tensors."""
    from nemo_refit_reshard.engine.program import TORCH_DTYPES
    from nemo_refit_reshard.plan import plan_refit
    from nemo_refit_reshard.runner import RunConfig, build_layouts
    from nemo_refit_reshard.spec.model import preset_configs

    t0 = time.perf_counter()
    first, last = stages or (None, None)
    cfg = RunConfig(
        model=model_name,
        train=train_text,
        infer=infer_text,
        first_stage_layers=first,
        last_stage_layers=last,
    )
    spec, sources, destinations = build_layouts(cfg)
    _, infer = cfg.parallel()
    plan = plan_refit(spec, sources, destinations)
    t_plan = time.perf_counter() - t0

    stored = {p.canonical for d in destinations for t in d.tensors for p in t.pieces}
    tensors = [t for t in spec if t.name in stored]  # vLLM's main model (no MTP layers)
    dtype = {t.name: TORCH_DTYPES[t.dtype] for t in tensors}

    hf = preset_configs()[model_name]
    keep = kept_layers(hf)
    rep = {t.name: representative(t.name, keep) for t in tensors}
    rep_tensors = {rep[t.name]: t for t in tensors}  # one per representative name
    rnames = list(rep_tensors)
    return Case(
        plan=plan,
        infer=infer,
        num_sources=len(sources),
        num_workers=len(destinations),
        held=held_boxes(sources),
        tensors=tensors,
        dropped=[t.name for t in spec if t.name not in stored],
        dtype=dtype,
        nbytes={t.name: t.numel * dtype[t.name].itemsize for t in tensors},
        keep=keep,
        small=truncated_config(hf),
        rep=rep,
        rnames=rnames,
        rdtypes=[dtype[rep_tensors[n].name] for n in rnames],
        rshapes=[tuple(rep_tensors[n].shape) for n in rnames],
        plan_seconds=t_plan,
    )


def rank_models(case: Case) -> Iterator[torch.nn.Module]:
    """vLLM's model of one worker per TP position (inference replicas are identical),
    built on the meta device with ``keep`` layers, in TP order. Each is built just before
    it is yielded: vLLM's parallel groups are that rank's while it is used."""
    from tests.helpers.vllm_cpu import EngineRank, build_model

    infer = case.infer
    assert infer.pp == 1, "vLLM pipeline parallel: not covered here"
    for tp_rank in range(infer.tp):
        rank = EngineRank(
            tp=infer.tp,
            pp=1,
            engine_dp=infer.engine_dp,
            expert_parallel=infer.expert_parallel,
            tp_rank=tp_rank,
        )
        model, _ = build_model(case.small, rank, "meta", "bfloat16")
        yield model
