"""Tensors vLLM derives from the loaded weights, kept current across refits.

vLLM's ``MLAAttention.process_weights_after_loading`` (``layers/attention/mla_attention.py``)
absorbs ``kv_b_proj`` into two tensors the decode path multiplies with::

    W = dequant(kv_b_proj).T.view(L, N, P + V);  W_UK, W_UV = W.split([P, V], -1)
    W_UV   <- W_UV.transpose(0, 1)      [N, L, V]
    W_UK_T <- W_UK.permute(1, 2, 0)     [N, P, L]

and registers both as parameters (``replace_parameter``). With an unquantized
``kv_b_proj`` they are views of its weight, so a refit of the weight changes them too;
with a block-FP8 ``kv_b_proj`` ``dequant`` makes a copy (e4m3 × its block scale, in the
model dtype), which no refit of ``named_parameters()`` touches: the vLLM engine would decode
with the previous step's attention while every refit parameter checks bit-exact.

So the derived tensors are not refit (they are in no checkpoint the trainer holds) and,
after every refit, each MLA layer whose derived tensors are copies runs vLLM's own
``process_weights_after_loading`` again. In 0.33 ``replace_parameter`` copies into the
existing parameter when shape, stride, dtype and device match, which they do on a
rerun; where the rerun rebinds instead (0.33's ``replace_parameter`` otherwise; 0.25
assigns ``self.W_UV = ...``), the new values are copied into the previous storage and
it is put back. Either way the storage stays put, so CUDA graphs captured by vLLM stay
valid; a derived tensor whose shape, stride or dtype changed cannot be, and raises.

The MLA variants whose derivation cannot be rerun that way are refused by name
(:func:`check_derived`); the survey of every ``process_weights_after_loading`` of the
families served is in docs/layouts.md ("Derived tensors inside vLLM").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .config import UnsupportedVllmOption

# What MLAAttention derives from kv_b_proj (default path; DCP query replication; ROCm
# aiter FP8/FP4 BMM). Each is registered on the MLAAttention module itself.
MLA_DERIVED = ("W_UK_T", "W_UV", "W_UK_T_dcp_qrep", "W_K", "W_K_scale", "W_V", "W_V_scale")


class DerivedWeightsMoved(RuntimeError):
    """vLLM's rerun reallocated a derived tensor: captured CUDA graphs would read the old one."""


def _mla_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    from vllm.model_executor.layers.attention import MLAAttention  # 0.25 and 0.33 alike

    for name, module in model.named_modules():
        if isinstance(module, MLAAttention):
            yield name, module


def _derived(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The derived tensors an MLA layer holds now (none before vLLM processed it)."""
    out = {}
    for attr in MLA_DERIVED:
        tensor = getattr(module, attr, None)
        if isinstance(tensor, torch.Tensor):
            out[attr] = tensor
    return out


def derived_parameter_names(model: torch.nn.Module) -> frozenset[str]:
    """Full names of the parameters vLLM derived after loading (never refit)."""
    names = set()
    for layer, module in _mla_layers(model):
        for attr, _ in module.named_parameters(recurse=False):
            if attr in MLA_DERIVED:
                names.add(f"{layer}.{attr}")
    return frozenset(names)


def check_derived(model: torch.nn.Module) -> None:
    """Refuse layers whose derived tensors cannot be rerun in place after a refit.

    * MLA on CPU AMX (``AMXMLAImpl``): packs its own copies and releases
      ``kv_b_proj.weight`` (an empty tensor is left: nothing to refit it into);
    * MLA with ROCm aiter Triton FP8/FP4 BMM: ``W_K``/``W_V`` requantized, and the
      rerun recompiles its kernel for 1024 batch sizes (~50 s on DeepSeek-R1);
    * MLA with DCP query replication: ``W_UK_T_dcp_qrep`` is an all-gather over vLLM's
      DCP group (decode context parallel is refused by ``engine_layout`` already);
    * MoE routers with ROCm's BF16x3 router GEMM: ``_bf16x3_weight`` is rebound, not
      copied in place.
    """
    bad = []
    for name, module in model.named_modules():
        if getattr(module, "is_amx_bmm_enabled", False):
            bad.append(f"{name}: AMX MLA (AMXMLAImpl releases kv_b_proj.weight)")
        elif getattr(module, "is_aiter_triton_fp8_bmm_enabled", False) or getattr(
            module, "is_aiter_triton_fp4_bmm_enabled", False
        ):
            bad.append(f"{name}: ROCm aiter Triton FP8/FP4 MLA BMM")
        elif getattr(module, "dcp_q_replicate", False):
            bad.append(f"{name}: DCP query replication (W_UK_T_dcp_qrep)")
        elif getattr(module, "allow_rocm_bf16x3_router_gemm", False):
            bad.append(f"{name}: ROCm BF16x3 router GEMM (_bf16x3_weight)")
    if bad:
        shown = ", ".join(bad[:4]) + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else "")
        raise UnsupportedVllmOption(
            "layers that derive tensors from the loaded weights in a way a refit cannot "
            f"rerun in place: {shown}; serve on CUDA with decode_context_parallel_size=1 "
            "(MLA: W_UK_T/W_UV recomputed in place after every refit)"
        )


def _aliases(tensor: torch.Tensor, weight: torch.Tensor | None) -> bool:
    return weight is not None and (
        tensor.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    )


@dataclass(frozen=True)
class DerivedWeights:
    """The MLA layers whose derived tensors are copies of ``kv_b_proj`` (block-FP8: its
    dequantization), rerun after every refit; views of the weight need nothing."""

    layers: tuple[tuple[str, torch.nn.Module], ...]
    act_dtype: torch.dtype
    vllm_config: Any

    @classmethod
    def of(cls, model: torch.nn.Module, vllm_config: Any) -> DerivedWeights:
        """Check the model (:func:`check_derived`) and find its layers to rerun."""
        check_derived(model)
        layers = []
        for name, module in _mla_layers(model):
            derived = _derived(module)
            weight = getattr(getattr(module, "kv_b_proj", None), "weight", None)
            if derived and not all(_aliases(t, weight) for t in derived.values()):
                layers.append((name, module))
        return cls(tuple(layers), vllm_config.model_config.dtype, vllm_config)

    def rerun(self) -> None:
        """vLLM's own ``process_weights_after_loading`` of each layer, after a refit wrote
        its ``kv_b_proj``: the derived tensors as a fresh load gives them, in place."""
        if not self.layers:
            return
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            for name, module in self.layers:
                # the objects and their storage (``.data`` keeps a rebound parameter's)
                before = {a: (t, t.data) for a, t in _derived(module).items()}
                module.process_weights_after_loading(self.act_dtype)
                _keep_storage(name, module, before)


def _keep_storage(
    name: str, module: torch.nn.Module, before: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Put each derived tensor that the rerun rebound back on its previous storage,
    holding the rerun's values."""
    after = _derived(module)
    for attr, (obj, data) in before.items():
        new = after.get(attr)
        if new is not None and new.data_ptr() == data.data_ptr():
            continue  # copied in place (vLLM 0.33's replace_parameter)
        same = new is not None and (
            (new.shape, new.stride(), new.dtype, new.device)
            == (data.shape, data.stride(), data.dtype, data.device)
        )
        if not same:
            raise DerivedWeightsMoved(
                f"{name}.{attr}: vLLM's process_weights_after_loading gave a tensor of "
                "another shape, stride or dtype after a refit; captured CUDA graphs would "
                "read the previous step's (serve with enforce_eager=True)"
            )
        data.copy_(new.data)
        if isinstance(obj, torch.nn.Parameter):
            obj.data = data  # the same parameter object, its storage back
        setattr(module, attr, obj)
