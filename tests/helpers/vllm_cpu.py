"""Build vLLM's own model classes on CPU, one rank at a time (runs where vLLM is installed).

vLLM is installed from its wheel with ``--no-deps`` into a CPU-torch environment
(``scripts/setup_vllm_cpu.sh``); its CUDA kernels do not load there, but its model
classes construct. What cannot run on CPU is replaced by stand-ins:

* ``vllm.distributed.parallel_state``'s group objects (``_WORLD, _TP, _PP, _DP, _EP,
  _PCP, _DCP``) become :class:`StandInGroup` s that only know a size and a rank — the
  model constructors read nothing else from them;
* releases before 0.33 do not detect the CPU platform from ``VLLM_TARGET_DEVICE`` at run
  time: the CPU platform is set explicitly.

Everything else — ``VllmConfig``, the model registry, the layers and their
``weight_loader`` s, ``load_weights`` — is vLLM's own code.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402


class _StandInDeviceGroup:
    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class StandInGroup:
    """What vLLM's model constructors read from a ``GroupCoordinator``."""

    def __init__(self, world_size: int, rank_in_group: int) -> None:
        self.world_size = world_size
        self.rank_in_group = rank_in_group
        self.rank = rank_in_group
        self.ranks = list(range(world_size))
        self.local_rank = 0
        self.first_rank, self.last_rank = 0, world_size - 1
        self.is_first_rank = rank_in_group == 0
        self.is_last_rank = rank_in_group == world_size - 1
        self.device_group = _StandInDeviceGroup(world_size, rank_in_group)
        self.cpu_group = self.device_group
        self.device_communicator = None
        self.use_device_communicator = False
        self.unique_name = "stand-in"


@dataclass(frozen=True)
class EngineRank:
    """One rank of one vLLM engine: its parallel sizes and coordinates."""

    tp: int = 1
    pp: int = 1
    engine_dp: int = 1
    expert_parallel: bool = False
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    all2all_backend: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineRank:
        return cls(**d)


def use_cpu_platform() -> None:
    """Releases before 0.33 do not detect the CPU platform at run time. Call before
    anything imports ``current_platform`` (vLLM's modules bind it on import).

    Also a stand-in, whatever the machine: this process reports no AMX. On a CPU with
    AMX tiles vLLM's CPU platform picks kernels that need vLLM's compiled CPU ops (its
    AMX MLA backend, which releases ``kv_b_proj``; packed GEMMs through
    ``torch.ops._C.convert_weight_packed``), which the test venv (vLLM's Python over a
    CPU torch) does not have, and which no CUDA engine runs; without AMX vLLM takes its
    reference CPU paths, which keep weights as loaded, as the CUDA kernels do."""
    torch.cpu._is_amx_tile_supported = lambda: False  # read at kernel choice, not import
    import vllm.platforms as platforms

    if getattr(platforms.current_platform, "device_name", None) != "cpu":
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()


def allow_fp8_block_kernel_on_cpu() -> None:
    """vLLM's FP8 layers pick a kernel after registering their parameters; on a CPU
    without AMX every CPU block-FP8 kernel declines and the build stops, and no FP8 MoE
    backend is chosen. Only those choices are bypassed: the linear layers take vLLM's
    Triton block kernel and the MoE layers its Triton backend (what a CUDA GPU without
    DeepGEMM picks; both use weights and scales as loaded). The parameters, their shapes
    and loaders are vLLM's own, and nothing here runs an FP8 matmul."""
    try:
        from vllm.model_executor.kernels import linear
        from vllm.model_executor.kernels.linear.scaled_mm.triton import (
            TritonFp8BlockScaledMMKernel,
        )
        from vllm.model_executor.layers.fused_moe.oracle import fp8 as moe_oracle
        from vllm.model_executor.layers.quantization import fp8
        from vllm.platforms import PlatformEnum
    except ImportError:  # releases without these tables
        return
    TritonFp8BlockScaledMMKernel.is_supported = classmethod(lambda cls, cc=None: (True, None))
    linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU] = [TritonFp8BlockScaledMMKernel]
    triton = moe_oracle.Fp8MoeBackend.TRITON
    fp8.select_fp8_moe_backend = lambda *a, **k: (
        triton,
        moe_oracle.backend_to_kernel_cls(triton)[0],
    )


def _set_groups(r: EngineRank) -> None:
    from vllm.distributed import parallel_state as ps

    moe_size = r.tp * r.engine_dp
    ps._WORLD = StandInGroup(
        r.tp * r.pp * r.engine_dp, (r.dp_rank * r.pp + r.pp_rank) * r.tp + r.tp_rank
    )
    ps._TP = StandInGroup(r.tp, r.tp_rank)
    ps._PP = StandInGroup(r.pp, r.pp_rank)
    ps._DP = StandInGroup(r.engine_dp, r.dp_rank)
    ps._EP = StandInGroup(moe_size, r.dp_rank * r.tp + r.tp_rank)
    ps._PCP = StandInGroup(1, 0)
    ps._DCP = StandInGroup(1, 0)


def config_dir(hf_config: dict[str, Any]) -> str:
    """A directory holding ``hf_config`` as config.json, one per distinct config and
    shared by every process (vLLM reads it again while it builds the model, and many
    of its processes end without running exit handlers, so one directory per build
    would be left behind by each)."""
    text = json.dumps(hf_config, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    model_dir = os.path.join(tempfile.gettempdir(), f"nrr-vllm-cpu-config-{digest}")
    os.makedirs(model_dir, exist_ok=True)
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        # written whole under another name, then renamed: a reader never sees half of it
        fd, tmp = tempfile.mkstemp(dir=model_dir, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return model_dir


def vllm_config(hf_config: dict[str, Any], r: EngineRank, dtype: str | None = None):
    """vLLM's ``VllmConfig`` for a model directory holding ``hf_config`` as config.json."""
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig

    model_dir = config_dir(hf_config)
    model = ModelConfig(
        model=model_dir,
        skip_tokenizer_init=True,
        max_model_len=min(64, int(hf_config.get("max_position_embeddings", 64))),
        enforce_eager=True,
        dtype=dtype or "auto",
    )
    extra = {} if r.all2all_backend is None else {"all2all_backend": r.all2all_backend}
    parallel = ParallelConfig(
        tensor_parallel_size=r.tp,
        pipeline_parallel_size=r.pp,
        data_parallel_size=r.engine_dp,
        data_parallel_rank=r.dp_rank,
        enable_expert_parallel=r.expert_parallel,
        distributed_executor_backend="mp",
        **extra,
    )
    return VllmConfig(
        model_config=model,
        parallel_config=parallel,
        device_config=DeviceConfig("cpu"),
        load_config=LoadConfig(load_format="dummy"),
    )


def _forget_pp_missing_layers() -> None:
    """vLLM caches each model's pipeline-missing layers by ``id(model)``: one model per
    process there, many here, and a new model can reuse a freed one's id (then its
    ``load_weights`` skips the wrong layers)."""
    from vllm.model_executor.models import utils

    cache = getattr(utils, "_model_to_pp_missing_layer_names", None)
    if cache is not None:
        cache.clear()


def build_model(
    hf_config: dict[str, Any], r: EngineRank, device: str = "meta", dtype: str | None = None
) -> tuple[torch.nn.Module, Any]:
    """vLLM's model class for ``hf_config`` as engine rank ``r`` builds it, on ``device``."""
    use_cpu_platform()  # first: vLLM's modules bind the platform when imported
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import get_model_architecture

    _forget_pp_missing_layers()
    if device == "meta" and not meta_builds():
        device = "cpu"  # older releases read tensor values while building (small models)
    if hf_config.get("quantization_config"):
        allow_fp8_block_kernel_on_cpu()
    config = vllm_config(hf_config, r, dtype)
    _set_groups(r)
    # As vLLM's model loader does: parameters take the model dtype by default.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(config.model_config.dtype)
    try:
        with set_current_vllm_config(config):
            model_cls, _ = get_model_architecture(config.model_config)
            with torch.device(device):
                model = model_cls(vllm_config=config, prefix="")
    finally:
        torch.set_default_dtype(previous)
    return model, config


def describe(model: torch.nn.Module) -> dict[str, list[Any]]:
    return {
        name: [list(p.shape), str(p.dtype).removeprefix("torch.")]
        for name, p in model.named_parameters()
    }


def checkpoint_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    yield from load_file(path).items()


def meta_builds() -> bool:
    """Whether this release's model classes build on the meta device (0.33 does; 0.24 and
    0.25 call ``Tensor.item()`` while building FusedMoE)."""
    major, minor = (int(x) for x in vllm_version().split(".")[:2])
    return (major, minor) >= (0, 33)


def vllm_version() -> str:
    import vllm

    return vllm.__version__
