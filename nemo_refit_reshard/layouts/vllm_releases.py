"""The vLLM release registry: which layout facts differ between vLLM releases
(:class:`VllmRelease`, one entry per ``major.minor`` in :data:`VLLM_RELEASES`, each read
from that release's source), which release a layout follows (:func:`vllm_release`: the
one asked for, else the installed vLLM's by package metadata, else
:data:`DEFAULT_VLLM_VERSION`), and the options a vLLM layout takes (:class:`VllmOptions`),
including vLLM's rule for sequence-parallel MoE. vLLM itself is never imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import metadata

from ..spec.parallel import InferParallel


@dataclass(frozen=True)
class VllmRelease:
    """The layout facts that differ between vLLM releases.

    ``expert_module``: the module under ``mlp`` that owns ``w13_weight``/``w2_weight``.
    ``sequence_parallel_backends``: all2all backends for which vLLM's
    ``ParallelConfig.use_sequence_parallel_moe`` holds (with EP, tp > 1, dp > 1).
    ``removed_backends``: backends the release replaces by ``allgather_reducescatter``.
    """

    version: str
    expert_module: str
    sequence_parallel_backends: frozenset[str]
    default_all2all_backend: str = "allgather_reducescatter"
    removed_backends: frozenset[str] = field(default_factory=frozenset)

    def all2all_backend(self, requested: str | None) -> str:
        backend = requested or self.default_all2all_backend
        return "allgather_reducescatter" if backend in self.removed_backends else backend


_SP_024 = frozenset(
    {
        "allgather_reducescatter",
        "deepep_high_throughput",
        "deepep_low_latency",
        "mori_high_throughput",
        "mori_low_latency",
        "nixl_ep",
    }
)
# Keyed by "major.minor"; each entry was read from that release's source
# (config/parallel.py ``use_sequence_parallel_moe``, fused_moe/layer.py, deepseek_v2.py).
VLLM_RELEASES: dict[str, VllmRelease] = {
    "0.11": VllmRelease(
        "0.11",
        "experts",
        frozenset(
            {"allgather_reducescatter", "naive", "deepep_high_throughput", "deepep_low_latency"}
        ),
    ),
    "0.24": VllmRelease(
        "0.24", "experts.routed_experts", _SP_024, removed_backends=frozenset({"naive", "pplx"})
    ),
    "0.25": VllmRelease(
        "0.25", "experts.routed_experts", _SP_024, removed_backends=frozenset({"naive", "pplx"})
    ),
    "0.33": VllmRelease(
        "0.33",
        "experts.routed_experts",
        _SP_024 | {"deepep_v2", "flashinfer_nvlink_one_sided", "passthrough"},
        removed_backends=frozenset({"naive", "pplx"}),
    ),
}
DEFAULT_VLLM_VERSION = "0.33"


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (package metadata; vLLM itself is not imported)."""
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def vllm_release(version: str | None = None) -> VllmRelease:
    """The release rules for ``version`` ("0.33.0", "0.25.1+cu128", ...); ``None`` means
    the installed vLLM, else :data:`DEFAULT_VLLM_VERSION`."""
    text = version or installed_vllm_version() or DEFAULT_VLLM_VERSION
    parts = text.split("+")[0].split(".")
    key = ".".join(parts[:2])
    if key not in VLLM_RELEASES:
        known = ", ".join(f"{k}.x" for k in VLLM_RELEASES)
        origin = "" if version else " (the installed vLLM)"
        raise ValueError(
            f"vLLM {text}{origin} is not a release whose parameter layout this provider knows; "
            f"known: {known}. Pass VllmOptions(vllm_version=...) / --vllm-version for one of "
            "those only if your release builds the same parameters (the vLLM truth test checks it)"
        )
    return VLLM_RELEASES[key]


@dataclass(frozen=True)
class VllmOptions:
    """``pp_layer_partition``: as ``VLLM_PP_LAYER_PARTITION`` (layer count per stage).
    ``params_dtype``: dtype of the local tensors (default: the checkpoint dtype).
    ``vllm_version``: the release whose layout to follow (default: the installed vLLM,
    else 0.33). ``all2all_backend``: vLLM's ``ParallelConfig.all2all_backend`` (default:
    the release's default); with expert parallel it decides sequence-parallel MoE."""

    pp_layer_partition: tuple[int, ...] | None = None
    params_dtype: str | None = None
    vllm_version: str | None = None
    all2all_backend: str | None = None

    @property
    def release(self) -> VllmRelease:
        return vllm_release(self.vllm_version)

    def sequence_parallel_moe(self, par: InferParallel) -> bool:
        """vLLM's ``ParallelConfig.use_sequence_parallel_moe`` for ``par``."""
        rel = self.release
        return (
            rel.all2all_backend(self.all2all_backend) in rel.sequence_parallel_backends
            and par.expert_parallel
            and par.tp > 1
            and par.engine_dp > 1
        )

    @classmethod
    def from_env(cls) -> VllmOptions:
        text = os.environ.get("VLLM_PP_LAYER_PARTITION")
        if not text:
            return cls()
        try:
            return cls(pp_layer_partition=tuple(int(x) for x in text.split(",")))
        except ValueError:
            raise ValueError(
                f"VLLM_PP_LAYER_PARTITION={text!r} is not a comma list of ints"
            ) from None
