"""The canonical model: the HuggingFace checkpoint tensors, in checkpoint order.

Both sides of a refit hold the same canonical tensors under different layouts.
The canonical names are the on-disk checkpoint names (transformers 5.x fuses
MoE experts in memory but still saves ``mlp.experts.{e}.gate_proj.weight``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from .config import ArchConfig, arch_from_hf_config
from .quantization import FP8, SCALE_SUFFIX, BlockFp8, check_ignored, quantized_module


@dataclass(frozen=True)
class CanonicalTensor:
    """One checkpoint tensor: its HF name, global shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


Named = TypeVar("Named")


def index_by_name(items: Iterable[Named], owner: str) -> dict[str, Named]:
    """``{item.name: item}``; refused when two items share a name (``owner`` says whose)."""
    index: dict[str, Named] = {}
    for item in items:
        name = item.name  # type: ignore[attr-defined]
        if name in index:
            raise ValueError(f"{owner} has duplicate tensor names ({name!r} twice)")
        index[name] = item
    return index


@dataclass(frozen=True)
class ModelSpec:
    """The ordered canonical tensors of a model plus the facts they came from."""

    name: str
    arch: ArchConfig
    tensors: tuple[CanonicalTensor, ...]
    _index: dict[str, CanonicalTensor] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index = index_by_name(self.tensors, f"model spec {self.name!r}")
        object.__setattr__(self, "_index", index)

    def __iter__(self) -> Iterator[CanonicalTensor]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def tensor(self, name: str) -> CanonicalTensor:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"model {self.name!r} has no canonical tensor {name!r}") from None

    @property
    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors)

    def unquantized(self) -> ModelSpec:
        """The same model as trained: every tensor in the model's dtype, no FP8 scales
        (itself when not quantized). A training framework holds these."""
        if self.arch.quant is None:
            return self
        arch = replace(self.arch, quant=None)
        return ModelSpec(self.name, arch, canonical_tensors(arch))

    def quantized(self, quant: BlockFp8) -> ModelSpec:
        """The same model served block-FP8 with ``quant`` (what vLLM builds when a
        framework quantizes a trained checkpoint at load, e.g. NeMo RL's
        ``vllm_cfg.precision: fp8``)."""
        arch = replace(self.arch, quant=quant)
        return ModelSpec(self.name, arch, canonical_tensors(arch))


def _attention(a: ArchConfig, p: str, dtype: str) -> list[CanonicalTensor]:
    h, hd = a.hidden_size, a.head_dim
    nq, ng = a.num_attention_heads, a.num_key_value_heads
    out: list[CanonicalTensor] = []
    if a.mla is not None:
        m = a.mla
        if m.q_lora_rank is None:
            out.append(CanonicalTensor(f"{p}.q_proj.weight", (nq * m.qk_head_dim, h), dtype))
        else:
            out += [
                CanonicalTensor(f"{p}.q_a_proj.weight", (m.q_lora_rank, h), dtype),
                CanonicalTensor(f"{p}.q_a_layernorm.weight", (m.q_lora_rank,), dtype),
                CanonicalTensor(f"{p}.q_b_proj.weight", (nq * m.qk_head_dim, m.q_lora_rank), dtype),
            ]
        out += [
            CanonicalTensor(
                f"{p}.kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, h), dtype
            ),
            CanonicalTensor(f"{p}.kv_a_layernorm.weight", (m.kv_lora_rank,), dtype),
            CanonicalTensor(
                f"{p}.kv_b_proj.weight",
                (nq * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                dtype,
            ),
            CanonicalTensor(f"{p}.o_proj.weight", (h, nq * m.v_head_dim), dtype),
        ]
        return out
    out += [
        CanonicalTensor(f"{p}.q_proj.weight", (nq * hd, h), dtype),
        CanonicalTensor(f"{p}.k_proj.weight", (ng * hd, h), dtype),
        CanonicalTensor(f"{p}.v_proj.weight", (ng * hd, h), dtype),
    ]
    if a.qkv_bias:
        out += [
            CanonicalTensor(f"{p}.q_proj.bias", (nq * hd,), dtype),
            CanonicalTensor(f"{p}.k_proj.bias", (ng * hd,), dtype),
            CanonicalTensor(f"{p}.v_proj.bias", (ng * hd,), dtype),
        ]
    out.append(CanonicalTensor(f"{p}.o_proj.weight", (h, nq * hd), dtype))
    if a.qk_norm:
        out += [
            CanonicalTensor(f"{p}.q_norm.weight", (hd,), dtype),
            CanonicalTensor(f"{p}.k_norm.weight", (hd,), dtype),
        ]
    return out


def _ffn(p: str, hidden: int, inter: int, dtype: str) -> list[CanonicalTensor]:
    return [
        CanonicalTensor(f"{p}.gate_proj.weight", (inter, hidden), dtype),
        CanonicalTensor(f"{p}.up_proj.weight", (inter, hidden), dtype),
        CanonicalTensor(f"{p}.down_proj.weight", (hidden, inter), dtype),
    ]


def _mlp(a: ArchConfig, layer: int, p: str, dtype: str) -> list[CanonicalTensor]:
    h = a.hidden_size
    if not a.is_sparse(layer):
        return _ffn(p, h, a.intermediate_size, dtype)
    moe = a.moe
    assert moe is not None
    out = [CanonicalTensor(f"{p}.gate.weight", (moe.num_experts, h), dtype)]
    if moe.router_bias:
        # DeepSeek-V3 keeps the routing bias in float32 in its checkpoint.
        out.append(
            CanonicalTensor(f"{p}.gate.e_score_correction_bias", (moe.num_experts,), "float32")
        )
    for e in range(moe.num_experts):
        out += _ffn(f"{p}.experts.{e}", h, moe.expert_intermediate_size, dtype)
    if moe.num_shared_experts:
        out += _ffn(f"{p}.shared_experts", h, moe.shared_intermediate_size, dtype)
    return out


def _decoder_layer(a: ArchConfig, layer: int, dtype: str) -> list[CanonicalTensor]:
    p = f"model.layers.{layer}"
    h = a.hidden_size
    out = [CanonicalTensor(f"{p}.input_layernorm.weight", (h,), dtype)]
    out += _attention(a, f"{p}.self_attn", dtype)
    out.append(CanonicalTensor(f"{p}.post_attention_layernorm.weight", (h,), dtype))
    out += _mlp(a, layer, f"{p}.mlp", dtype)
    return out


def _mtp_layer(a: ArchConfig, layer: int, dtype: str) -> list[CanonicalTensor]:
    """DeepSeek-V3 multi-token-prediction layer as saved in its checkpoint."""
    p = f"model.layers.{layer}"
    h, v = a.hidden_size, a.vocab_size
    out = [
        CanonicalTensor(f"{p}.embed_tokens.weight", (v, h), dtype),
        CanonicalTensor(f"{p}.enorm.weight", (h,), dtype),
        CanonicalTensor(f"{p}.hnorm.weight", (h,), dtype),
        CanonicalTensor(f"{p}.eh_proj.weight", (h, 2 * h), dtype),
    ]
    out += _decoder_layer(a, layer, dtype)
    out += [
        CanonicalTensor(f"{p}.shared_head.norm.weight", (h,), dtype),
        CanonicalTensor(f"{p}.shared_head.head.weight", (v, h), dtype),
    ]
    return out


def canonical_tensors(a: ArchConfig) -> tuple[CanonicalTensor, ...]:
    """The checkpoint tensors of ``a`` in checkpoint order."""
    dtype = a.dtype
    out = [CanonicalTensor("model.embed_tokens.weight", (a.vocab_size, a.hidden_size), dtype)]
    for layer in range(a.num_layers):
        out += _decoder_layer(a, layer, dtype)
    out.append(CanonicalTensor("model.norm.weight", (a.hidden_size,), dtype))
    if not a.tie_word_embeddings:
        out.append(CanonicalTensor("lm_head.weight", (a.vocab_size, a.hidden_size), dtype))
    for k in range(a.num_mtp_layers):
        out += _mtp_layer(a, a.num_layers + k, dtype)
    return tuple(_block_fp8(a, out) if a.quant is not None else out)


def _block_fp8(a: ArchConfig, tensors: list[CanonicalTensor]) -> list[CanonicalTensor]:
    """A block-FP8 checkpoint's tensors: each quantized weight as e4m3, followed by its
    float32 ``weight_scale_inv`` (``spec/quantization.py``)."""
    q = a.quant
    assert q is not None
    modules = {m for t in tensors if (m := quantized_module(t.name, a.family))}
    check_ignored(q, modules)
    out = []
    for t in tensors:
        module = quantized_module(t.name, a.family)
        if module is None or module in q.ignored:
            out.append(t)
            continue
        out.append(CanonicalTensor(t.name, t.shape, FP8))
        out.append(CanonicalTensor(f"{module}.{SCALE_SUFFIX}", q.scale_shape(t.shape), "float32"))
    return out


def spec_from_hf_config(cfg: dict[str, Any], name: str = "custom") -> ModelSpec:
    """Build the :class:`ModelSpec` of a HuggingFace ``config.json`` dict."""
    arch = arch_from_hf_config(cfg)
    return ModelSpec(name, arch, canonical_tensors(arch))


_PRESETS_FILE = Path(__file__).with_name("presets.json")


def preset_configs() -> dict[str, dict[str, Any]]:
    """Name -> HF config dict for every bundled preset (shape facts only, no weights)."""
    return json.loads(_PRESETS_FILE.read_text())


def load_model_spec(model: str | Path | dict[str, Any]) -> ModelSpec:
    """A spec from a preset name, a ``config.json`` path (file or folder) or a config dict."""
    if isinstance(model, dict):
        return spec_from_hf_config(model)
    presets = preset_configs()
    key = str(model).lower()
    if key in presets:
        return spec_from_hf_config(presets[key], name=key)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return spec_from_hf_config(json.loads(path.read_text()), name=str(model))
    raise ValueError(
        f"unknown model {str(model)!r}: not a preset ({', '.join(sorted(presets))}) "
        "and not a config.json file or a folder holding one"
    )
