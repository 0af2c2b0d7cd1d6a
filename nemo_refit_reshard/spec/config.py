"""Architecture facts read from a HuggingFace ``config.json``.

Only the keys that decide tensor names and shapes are kept. Each supported
``architectures[0]`` maps to a family; the family decides which keys are
required. A missing key is an error that names the key, so a truncated config
never silently produces a wrong tensor list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .quantization import BlockFp8, quantization_from_hf_config

# HF architecture class -> family understood by the spec and the providers.
ARCHITECTURE_FAMILIES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class MoeConfig:
    """Routed experts (and optional shared experts) of a mixture-of-experts model."""

    num_experts: int
    expert_intermediate_size: int
    sparse_layers: tuple[int, ...]  # decoder layer indices whose MLP is an MoE block
    num_shared_experts: int = 0  # DeepSeek: shared expert FFN = n_shared * expert size
    router_bias: bool = False  # DeepSeek-V3 e_score_correction_bias (in the checkpoint)
    # config.json's ``topk_method`` as written (None when absent). transformers saves the
    # correction bias unless it names another method; vLLM builds it only for an explicit
    # "noaux_tc", so the two sides can differ for a config without the key.
    topk_method: str | None = None

    @property
    def shared_intermediate_size(self) -> int:
        return self.num_shared_experts * self.expert_intermediate_size


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek multi-head latent attention dimensions."""

    q_lora_rank: int | None  # None: a plain q_proj instead of q_a/q_b
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class ArchConfig:
    """The shape-deciding facts of one causal LM."""

    family: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: MoeConfig | None = None
    mla: MlaConfig | None = None
    num_mtp_layers: int = 0
    quant: BlockFp8 | None = None  # block-FP8 checkpoint (``spec/quantization.py``)

    @property
    def queries_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.sparse_layers


# Keys that transformers 5.x writes under another name (``attribute_map``).
_ALIASES = {"num_experts": "num_local_experts"}


def _require(cfg: dict[str, Any], key: str, arch: str) -> Any:
    if cfg.get(key) is None and cfg.get(_ALIASES.get(key, "")) is not None:
        return cfg[_ALIASES[key]]
    if key not in cfg or cfg[key] is None:
        raise ValueError(
            f"config for {arch} is missing required key '{key}'; "
            f"add it to config.json (see the model's HuggingFace config)"
        )
    return cfg[key]


def _positive(value: Any, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config key '{key}' must be a positive integer, got {value!r}")
    return value


def _dtype(cfg: dict[str, Any]) -> str:
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    dtype = str(dtype).replace("torch.", "")
    if dtype not in DTYPES:
        raise ValueError(f"config key 'torch_dtype' is {dtype!r}; supported: {', '.join(DTYPES)}")
    return dtype


def arch_from_hf_config(cfg: dict[str, Any]) -> ArchConfig:
    """Read an :class:`ArchConfig` from a HuggingFace ``config.json`` dict."""
    archs = cfg.get("architectures")
    if not archs:
        raise ValueError(
            "config is missing required key 'architectures' "
            f"(one of: {', '.join(sorted(ARCHITECTURE_FAMILIES))})"
        )
    arch = archs[0]
    family = ARCHITECTURE_FAMILIES.get(arch)
    if family is None:
        raise ValueError(
            f"unsupported architecture '{arch}'; supported: "
            f"{', '.join(sorted(ARCHITECTURE_FAMILIES))}"
        )

    def req(key: str) -> int:
        return _positive(_require(cfg, key, arch), key)

    hidden = req("hidden_size")
    layers = req("num_hidden_layers")
    heads = req("num_attention_heads")
    kv_heads = _positive(cfg.get("num_key_value_heads") or heads, "num_key_value_heads")
    if heads % kv_heads:
        raise ValueError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    head_dim = cfg.get("head_dim") or hidden // heads
    if family == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ValueError(
            "LlamaForCausalLM with attention_bias/mlp_bias=true is not supported; "
            "set both to false (the default) or open an issue"
        )
    common = dict(
        family=family,
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=_positive(head_dim, "head_dim"),
        intermediate_size=req("intermediate_size"),
        vocab_size=req("vocab_size"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        dtype=_dtype(cfg),
        qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        quant=quantization_from_hf_config(cfg),
    )
    if family == "qwen3_moe":
        num_experts = req("num_experts")
        step = req("decoder_sparse_step")
        dense = set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        common["moe"] = MoeConfig(num_experts, req("moe_intermediate_size"), sparse)
    elif family == "deepseek_v3":
        first_dense = _require(cfg, "first_k_dense_replace", arch)
        freq = cfg.get("moe_layer_freq", 1)
        sparse = tuple(i for i in range(layers) if i >= first_dense and i % freq == 0)
        n_mtp = int(cfg.get("num_nextn_predict_layers") or 0)
        # MTP layers are full MoE decoder layers appended after the main stack.
        sparse += tuple(range(layers, layers + n_mtp))
        common["moe"] = MoeConfig(
            num_experts=req("n_routed_experts"),
            expert_intermediate_size=req("moe_intermediate_size"),
            sparse_layers=sparse,
            num_shared_experts=int(cfg.get("n_shared_experts") or 0),
            router_bias=cfg.get("topk_method", "noaux_tc") == "noaux_tc",
            topk_method=cfg.get("topk_method"),
        )
        q_lora = cfg.get("q_lora_rank")
        common["mla"] = MlaConfig(
            q_lora_rank=_positive(q_lora, "q_lora_rank") if q_lora is not None else None,
            kv_lora_rank=req("kv_lora_rank"),
            qk_nope_head_dim=req("qk_nope_head_dim"),
            qk_rope_head_dim=req("qk_rope_head_dim"),
            v_head_dim=req("v_head_dim"),
        )
        common["num_mtp_layers"] = n_mtp
        common["qk_norm"] = False
        common["qkv_bias"] = False
    return ArchConfig(**common)
