"""Block-quantized FP8 checkpoints: which canonical tensors are e4m3, and their scales.

A HuggingFace ``config.json`` with ``quantization_config = {"quant_method": "fp8",
"weight_block_size": [bn, bk], "activation_scheme": "dynamic"}`` (DeepSeek-V3, Kimi-K2,
Qwen3's ``-FP8`` checkpoints) makes vLLM build an FP8 engine, and its checkpoint holds,
for every linear layer vLLM quantizes, the weight ``W`` (``[out, in]``) as
``float8_e4m3fn`` and ``W.weight_scale_inv`` as float32 of shape
``[ceil(out/bn), ceil(in/bk)]``: block ``(i, j)`` of the weight dequantizes as
``W[i·bn:(i+1)·bn, j·bk:(j+1)·bk] · scale[i, j]``. Those are the canonical tensors of
such a model. vLLM quantizes every linear layer of the decoder (attention and MLP
projections, experts, Qwen3-MoE's router) except those ``ignored_layers`` (or
``modules_to_not_convert``) names; embeddings, ``lm_head``, norms, biases and
DeepSeek's router stay in the model's dtype.

Any other ``quant_method``, FP8 without ``weight_block_size`` (per-tensor scales), or a
static activation scheme is refused by name: never planned as if unquantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FP8 = "float8_e4m3fn"
SCALE_SUFFIX = "weight_scale_inv"


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``: the number of blocks of ``b`` that cover ``a``."""
    return -(-a // b)


def scale_name(weight: str) -> str:
    """The scale tensor of an FP8 weight: ``...weight`` -> ``...weight_scale_inv`` (vLLM's
    experts: ``w13_weight`` -> ``w13_weight_scale_inv``)."""
    return weight[: -len("weight")] + SCALE_SUFFIX


# The linear layers vLLM builds with the quantization config (HF module name endings).
_LINEARS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
)  # fmt: skip
# Modules vLLM fuses into one parameter: quantized or ignored together.
_FUSED = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
)


@dataclass(frozen=True)
class BlockFp8:
    """``quant_method: fp8`` with ``weight_block_size = block`` (rows, columns)."""

    block: tuple[int, int] = (128, 128)
    ignored: frozenset[str] = frozenset()  # HF module names left unquantized

    def __str__(self) -> str:
        return f"fp8 block {self.block[0]}x{self.block[1]}"

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        rows, cols = shape
        bn, bk = self.block
        return (cdiv(rows, bn), cdiv(cols, bk))


def quantization_from_hf_config(cfg: dict[str, Any]) -> BlockFp8 | None:
    """The ``quantization_config`` of a ``config.json`` as vLLM reads it for FP8 (its
    ``Fp8Config.from_config``); None when absent. Anything not modeled: ``ValueError``."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"quantization_config.quant_method={method!r} is not modeled: nemo-refit-reshard "
            "plans unquantized engines and block-quantized FP8 (quant_method 'fp8' with "
            "weight_block_size); serve this model unquantized or open an issue"
        )
    block = q.get("weight_block_size")
    if not block:
        raise ValueError(
            "quantization_config: fp8 without weight_block_size (per-tensor scales) is not "
            "modeled; only block-quantized FP8 (e.g. weight_block_size [128, 128]) is"
        )
    if len(block) != 2 or any(not isinstance(b, int) or b <= 0 for b in block):
        raise ValueError(f"quantization_config.weight_block_size={block!r}: two positive ints")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":  # vLLM's own rule for block FP8
        raise ValueError(
            f"quantization_config.activation_scheme={scheme!r}: block-wise FP8 supports the "
            "dynamic activation scheme only (vLLM refuses it too)"
        )
    ignored = q.get("ignored_layers") or q.get("modules_to_not_convert") or []
    return BlockFp8((int(block[0]), int(block[1])), frozenset(str(m) for m in ignored))


def quantized_module(name: str, family: str) -> str | None:
    """The HF module of canonical tensor ``name`` if vLLM builds that module as a
    quantized linear layer, else None. ``ignored_layers`` are not applied here: callers
    drop ``BlockFp8.ignored`` themselves (and :func:`check_ignored` keeps fused modules
    together)."""
    if not name.endswith(".weight"):
        return None
    module = name[: -len(".weight")]
    leaf = module.rsplit(".", 1)[-1]
    if leaf in _LINEARS:
        return module
    if family == "qwen3_moe" and module.endswith(".mlp.gate"):  # vLLM's GateLinear
        return module
    return None


def check_ignored(quant: BlockFp8, modules: set[str]) -> None:
    """vLLM quantizes a fused parameter whole: its modules all ignored or none."""
    for module in sorted(quant.ignored & modules):
        head, _, leaf = module.rpartition(".")
        for group in _FUSED:
            if leaf in group:
                mates = {f"{head}.{m}" for m in group} & modules
                if not mates <= quant.ignored:
                    rest = sorted(mates - quant.ignored)
                    raise ValueError(
                        f"quantization_config ignores {module} but not {rest}: vLLM fuses "
                        "them into one parameter, quantized or not as a whole"
                    )


__all__ = [
    "FP8",
    "SCALE_SUFFIX",
    "BlockFp8",
    "cdiv",
    "check_ignored",
    "quantization_from_hf_config",
    "scale_name",
]
