"""SGLang 0.5.23's model classes on CPU (the venv of scripts/setup_sglang_cpu.sh); also
0.5.12.post1's, NeMo RL's pin, built as that release builds them (``_build_model_0512``).

What makes ``sglang.srt.models.qwen3``, ``qwen3_moe`` and ``deepseek_v2`` import on a CPU torch
(:func:`import_sglang_models`), and :func:`build_model`: SGLang's runtime context
published with its own ``ServerArgs`` and ``publish`` (this rank's place given as SGLang's
launcher gives it, ``SpawnRanks``), SGLang's own parallel state over gloo
(``init_distributed_environment``, ``initialize_model_parallel``), and the model class
SGLang's registry resolves for ``config.json``, built for one tensor-parallel rank.
Stand-ins (each one unavoidable, each listed here):

1. ``torchvision``: SGLang's ``sglang.srt.configs`` imports ``torchvision.transforms`` at
   module level (InternVL / DeepSeek-VL2 / DeepSeek-OCR preprocessing), and transformers'
   image processors import ``torchvision.transforms.v2``. The only torchvision wheels here
   are CUDA builds whose ``_C.so`` needs ``libc10_cuda.so``, so importing one on the CPU
   torch fails (``operator torchvision::nms does not exist``). ``stub_torchvision()``
   answers every ``torchvision.*`` import with an empty module whose attributes are inert
   classes, except ``InterpolationMode`` (an enum: SGLang's transformers patches read its
   members). No text model path calls torchvision.
2. ``vllm._custom_ops.rotary_embedding``: off CUDA (and outside SGLang's CPU engine mode,
   which needs ``sgl_kernel``'s compiled CPU kernels), SGLang's ``RotaryEmbedding`` binds
   vLLM's CUDA rotary kernel as its fallback at construction. Only a forward pass calls
   it, which these tests do not run; the stand-in raises if called.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any


class InterpolationMode(enum.Enum):
    """The members of torchvision's enum that SGLang and transformers read."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _StubModule(types.ModuleType):
    """A torchvision module: any public name is an inert class (never called on text)."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "InterpolationMode":
            return InterpolationMode
        return type(name, (), {"__init__": lambda self, *args, **kwargs: None})


class _TorchvisionFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``torchvision`` and every submodule with a ``_StubModule`` package."""

    def find_spec(self, name: str, path: object = None, target: object = None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _StubModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        module.__version__ = "0.28.0"  # the version that pairs with torch 2.13


def stub_torchvision() -> None:
    """Install stand-in 1 before anything imports sglang (idempotent)."""
    if not any(isinstance(f, _TorchvisionFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionFinder())


def _not_run(*args: object, **kwargs: object) -> None:
    raise RuntimeError("stand-in for vLLM's CUDA rotary kernel: not run on CPU")


def stub_rotary_kernel() -> None:
    """Install stand-in 2 (idempotent)."""
    if "vllm._custom_ops" in sys.modules:
        return
    vllm = types.ModuleType("vllm")
    vllm.__path__ = []  # type: ignore[attr-defined]
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    ops = types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = _not_run  # type: ignore[attr-defined]
    vllm._custom_ops = ops  # type: ignore[attr-defined]
    sys.modules.update({"vllm": vllm, "vllm._custom_ops": ops})


def build_model(
    model_dir: str,
    tp: int,
    rank: int,
    port: int,
    ep: int = 1,
    fuse_shared: bool = False,
    pp: int = 1,
    dp: int = 1,
) -> Any:
    """SGLang's model class for ``config.json`` in ``model_dir``, rank ``rank`` of the
    ``tp·pp`` ranks of one engine (every rank a process; they meet at
    ``127.0.0.1:port``), float32 parameters on CPU, as SGLang's own code builds them.
    ``pp`` is ``--pp-size``: ``rank`` is SGLang's world rank ``pp_rank·tp + tp_rank``
    (``runtime_context.spawn_world_rank``). ``ep`` is ``--ep-size``;
    ``fuse_shared`` is ``--enforce-shared-experts-fusion`` (SGLang's default on a CUDA
    GPU for DeepSeek-V3's 256 experts; on CPU only the flag turns it on). The shared-expert
    decision is SGLang's loader's own (``resolve_shared_experts_config`` around the
    constructor, as ``model_loader.loader._initialize_model`` does). ``dp`` > 1 is
    ``--dp-size dp --enable-dp-attention`` (SGLang resolves it to ``--attn-dp-size dp``):
    ``tp`` stays SGLang's ``--tp-size``, every rank's attention data-parallel rank is
    ``tp_rank // (tp / dp)`` as its data-parallel controller spawns it
    (``compute_dp_attention_world_info``), and ``initialize_dp_attention`` runs after the
    parallel groups, as ``distributed/bootstrap._init_parallel_groups`` does. A
    ``quantization_config`` in ``config.json`` becomes the constructor's ``quant_config``
    as SGLang's loader makes it (0.5.23 only: block FP8 is not proven on 0.5.12.post1)."""
    stub_torchvision()
    stub_rotary_kernel()
    if importlib.util.find_spec("sglang.srt.runtime_context") is None:
        if dp > 1:  # built there, its attention still came out split over all tp ranks
            raise ValueError("dp attention is proven on SGLang 0.5.23 only (build_model)")
        if "quantization_config" in json.loads(Path(model_dir, "config.json").read_text()):
            raise ValueError("block FP8 is proven on SGLang 0.5.23 only (build_model)")
        return _build_model_0512(model_dir, tp, rank, port, ep, fuse_shared, pp)
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.layers.moe.utils import resolve_shared_experts_config
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.runtime_context import SpawnRanks, get_model, publish
    from sglang.srt.server_args import ServerArgs
    from transformers import AutoConfig

    args = ServerArgs(
        model_path=model_dir,
        device="cpu",
        tp_size=tp,
        pp_size=pp,
        ep_size=ep,
        enforce_shared_experts_fusion=fuse_shared,
        skip_tokenizer_init=True,
        **(dict(dp_size=dp, enable_dp_attention=True) if dp > 1 else {}),
    )
    dp_rank = (rank % tp) // (tp // dp)
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=rank, dp_rank=dp_rank, gpu_id=0))
    parallel_state.init_distributed_environment(
        world_size=tp * pp,
        rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        local_rank=rank,
        backend="gloo",
    )
    parallel_state.initialize_model_parallel(backend="gloo")
    initialize_dp_attention(args)
    config = AutoConfig.from_pretrained(model_dir)
    model_cls, _ = ModelRegistry.resolve_model_cls(config.architectures)
    shared = resolve_shared_experts_config(model_cls, config, None)
    with get_model().override(shared_experts=shared):
        model = model_cls(config, **_quant_config(config))
    model.shared_experts_config = shared
    return model


def _build_model_0512(
    model_dir: str, tp: int, rank: int, port: int, ep: int, fuse_shared: bool, pp: int
) -> Any:
    """:func:`build_model` for SGLang before ``sglang.srt.runtime_context`` (0.5.12.post1,
    NeMo RL's pin): the steps its scheduler and ``ModelRunner`` take before the loader's
    ``_initialize_model`` calls the model class -- the global server args
    (``set_global_server_args_for_scheduler``), the MoE globals (``initialize_moe_config``,
    ``Scheduler.init_moe_gemm_config``), parallel state with the expert-parallel size
    passed in and DP-attention's globals (``ModelRunner.init_torch_distributed``). The
    shared-expert decision is the model's own there (DeepSeek's constructor,
    ``determine_num_fused_shared_experts``)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from transformers import AutoConfig

    args = ServerArgs(
        model_path=model_dir,
        device="cpu",
        tp_size=tp,
        pp_size=pp,
        ep_size=ep,
        enforce_shared_experts_fusion=fuse_shared,
        skip_tokenizer_init=True,
    )
    set_global_server_args_for_scheduler(args)
    config = AutoConfig.from_pretrained(model_dir)
    if hasattr(config, "num_experts_per_tok"):
        initialize_moe_config(args)
    parallel_state.init_distributed_environment(
        world_size=tp * pp,
        rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        local_rank=rank,
        backend="gloo",
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        backend="gloo",
    )
    initialize_dp_attention(server_args=args, model_config=ModelConfig.from_server_args(args))
    model_cls, _ = ModelRegistry.resolve_model_cls(config.architectures)
    return model_cls(config)


def _quant_config(config: Any) -> dict[str, Any]:
    """``quant_config=`` as SGLang's loader passes it for a checkpoint's
    ``quantization_config`` (``get_quantization_config(method).from_config``; none
    without one)."""
    q = getattr(config, "quantization_config", None)
    if not q:
        return {}
    from sglang.srt.layers.quantization import get_quantization_config

    return {"quant_config": get_quantization_config(q["quant_method"]).from_config(q)}


def release_model() -> None:
    """Tear down SGLang's parallel state and the gloo world (what ``build_model`` set up),
    so that the process can build the next model (``publish`` is last-publish-wins)."""
    from sglang.srt.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()


def import_sglang_models() -> None:
    """Import on CPU what the tests build: SGLang's Llama, Qwen2, Qwen3, Qwen3-MoE and
    DeepSeek-V2/V3 model modules, its server args, runtime context, parallel state and registry."""
    stub_torchvision()
    stub_rotary_kernel()
    import sglang.srt.distributed.parallel_state  # noqa: F401
    import sglang.srt.models.deepseek_v2  # noqa: F401
    import sglang.srt.models.llama  # noqa: F401
    import sglang.srt.models.qwen2  # noqa: F401
    import sglang.srt.models.qwen3  # noqa: F401
    import sglang.srt.models.qwen3_moe  # noqa: F401
    import sglang.srt.models.registry  # noqa: F401
    import sglang.srt.server_args  # noqa: F401

    # SGLang 0.5.12.post1 (NeMo RL's pin) has no runtime context: _build_model_0512.
    if importlib.util.find_spec("sglang.srt.runtime_context") is not None:
        import sglang.srt.runtime_context  # noqa: F401
