"""A live Megatron training worker: its tensors under the Megatron layout's names, the
layout options its model decides, and its position in Megatron's process groups.

Frameworks hold Megatron-core models wrapped (``DistributedDataParallel``,
``Float16Module``: each keeps the model as ``.module``) and, with virtual pipeline
stages, as a list of chunks. The layout provider names tensors as an unwrapped
``GPTModel``'s ``state_dict`` does — ``decoder.layers.{i}...`` per stage, prefixed
``model{c}.`` for chunk ``c`` when there are several — and counts persistent
buffers the refit must write too (the MoE router's ``expert_bias``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...layouts import RankLayout
from ...plan import PlanError


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The innermost ``.module`` of wrapper modules (DDP, Float16Module, ...)."""
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return module


def megatron_live_tensors(
    model: torch.nn.Module | Sequence[torch.nn.Module],
) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers (not ``_extra_state``) by layout name; the
    tensors themselves, so a refit writes the live storage."""
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    out: dict[str, torch.Tensor] = {}
    for c, chunk in enumerate(chunks):
        prefix = f"model{c}." if len(chunks) > 1 else ""
        for name, value in unwrap(chunk).state_dict(keep_vars=True).items():
            if not name.endswith("_extra_state"):
                out[prefix + name] = value
    return out


def match_layout(live: Mapping[str, torch.Tensor], layout: RankLayout) -> dict[str, torch.Tensor]:
    """The live tensors the layout names; a ``PlanError`` lists every name the layout has
    and the model lacks, and every live parameter the layout does not cover."""
    wanted = {t.name for t in layout.tensors}
    missing = sorted(wanted - set(live))
    uncovered = sorted(
        n for n, t in live.items() if n not in wanted and isinstance(t, torch.nn.Parameter)
    )
    if missing or uncovered:
        lines = [f"{n}: in the layout, not in the model" for n in missing]
        lines += [f"{n}: a model parameter the layout does not cover" for n in uncovered]
        raise PlanError.listing(
            f"Megatron rank {layout.rank}: live tensors and layout disagree",
            lines,
            "check the layout options (layer spec, grouped GEMM, vocab padding, pipeline "
            "split) against the model's configuration",
        )
    return {n: live[n] for n in sorted(wanted)}


# Names only the Transformer Engine layer spec has: norms fused into the next linear.
_TE_FUSED_NORMS = (
    "linear_qkv.layer_norm_weight",
    "linear_fc1.layer_norm_weight",
    "linear_q_up_proj.layer_norm_weight",
    "linear_kv_up_proj.layer_norm_weight",
)


# Options a rank may be unable to tell from its own parameters; None then (it abstains).
UNKNOWABLE_OPTIONS = ("layer_spec", "moe_grouped_gemm")


def _layer_spec(names: Sequence[str]) -> str | None:
    """``"te"`` if a decoder layer has a norm fused into a linear, else ``"local"``; None
    for a rank without decoder layers (a pipeline stage of embedding or head only): every
    TE decoder layer fuses one (``linear_qkv``, MLA's up projections, or a dense
    ``linear_fc1``), but a rank with none has nothing to tell."""
    if not any(".layers." in n for n in names):
        return None
    return "te" if any(n.endswith(_TE_FUSED_NORMS) for n in names) else "local"


def _moe_grouped_gemm(names: Sequence[str], config: Any) -> bool | None:
    """Grouped GEMM is a property of the model's ``TransformerConfig``
    (``moe_grouped_gemm``, from which Megatron's block spec builds every MoE layer),
    the same on every rank — not of one rank's names: a pipeline stage of dense layers
    only (DeepSeek-V3's first three) holds no experts. A rank that holds experts must be
    named as its config says; without a config, those names decide and a rank without
    experts abstains (None)."""
    grouped = any(".mlp.experts.linear_fc1.weight" in n for n in names)
    sequential = any(".mlp.experts.local_experts." in n for n in names)
    named = True if grouped else (False if sequential else None)
    if not hasattr(config, "moe_grouped_gemm"):
        return named
    configured = bool(config.moe_grouped_gemm and getattr(config, "num_moe_experts", None))
    if named is not None and named != configured:
        grouped_names = "TEGroupedMLP's (experts.linear_fc1.weight{i})"
        kind = grouped_names if named else "SequentialMLP's (experts.local_experts.{i})"
        raise PlanError(
            f"Megatron model: its TransformerConfig says moe_grouped_gemm={configured} but "
            f"its experts are named as {kind}; build the layer spec from the config "
            "(get_gpt_decoder_block_spec) or set moe_grouped_gemm to match it"
        )
    return configured


def live_megatron_options(model: torch.nn.Module | Sequence[torch.nn.Module]) -> dict[str, Any]:
    """The ``MegatronOptions`` fields a live model decides, the same on every rank of one
    model: grouped GEMM and the uneven pipeline split from its ``TransformerConfig``
    (which every rank shares), the layer spec from its parameter names, the parameter
    dtype from its weights. A field in :data:`UNKNOWABLE_OPTIONS` is None where this
    rank cannot tell it (see :func:`_layer_spec`, :func:`_moe_grouped_gemm`): such a
    rank abstains when the ranks' reports are settled (``nemo_rl.plans``). (The
    vocabulary padding is not recoverable from one rank's shapes; the caller supplies
    it.)"""
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    names = list(megatron_live_tensors(chunks))
    first = unwrap(chunks[0])
    config = getattr(first, "config", None)
    dtype = next(first.parameters()).dtype
    return {
        "layer_spec": _layer_spec(names),
        "moe_grouped_gemm": _moe_grouped_gemm(names, config),
        "num_layers_in_first_pipeline_stage": getattr(
            config, "num_layers_in_first_pipeline_stage", None
        ),
        "num_layers_in_last_pipeline_stage": getattr(
            config, "num_layers_in_last_pipeline_stage", None
        ),
        "params_dtype": str(dtype).removeprefix("torch."),
    }


def live_megatron_position() -> dict[str, int]:
    """This process's coordinates and sizes in Megatron's ``parallel_state`` groups (the
    live position; ``layouts.megatron_position`` is the planned one)."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    return {
        "tp": ps.get_tensor_model_parallel_rank(),
        "cp": ps.get_context_parallel_rank(),
        "dp": ps.get_data_parallel_rank(with_context_parallel=False),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "etp": ps.get_expert_tensor_parallel_rank(),
        "ep": ps.get_expert_model_parallel_rank(),
        "edp": ps.get_expert_data_parallel_rank(),
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "pp_size": ps.get_pipeline_model_parallel_world_size(),
        "vpp_size": int(vpp or 1),
        "cp_size": ps.get_context_parallel_world_size(),
        "dp_size": ps.get_data_parallel_world_size(with_context_parallel=False),
        "ep_size": ps.get_expert_model_parallel_world_size(),
        "etp_size": ps.get_expert_tensor_parallel_world_size(),
    }


@torch.no_grad()
def load_canonical(
    params: Mapping[str, torch.Tensor], layout: RankLayout, canonical: Mapping[str, torch.Tensor]
) -> None:
    """Load HF checkpoint tensors into a live model through the layout:
    ``param[piece.local_box] = canonical[piece.canonical][piece.canonical_box]``; padding
    (vocabulary rows past the real vocabulary) is zero. ``params``: the live tensors by
    layout name (:func:`megatron_live_tensors`)."""
    for t in layout.tensors:
        p = params[t.name]
        p.zero_()
        for piece in t.pieces:
            src = canonical[piece.canonical][piece.canonical_box.slices()]
            p[piece.local_box.slices()] = src.reshape(piece.local_box.sizes).to(p.dtype)
