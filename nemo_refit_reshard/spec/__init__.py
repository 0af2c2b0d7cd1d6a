"""Layer 1: the canonical model (HF checkpoint tensors) and parallelism specs."""

from .config import ArchConfig, MlaConfig, MoeConfig, arch_from_hf_config
from .model import (
    CanonicalTensor,
    ModelSpec,
    canonical_tensors,
    load_model_spec,
    preset_configs,
    spec_from_hf_config,
)
from .parallel import InferParallel, TrainParallel, parse_parallel_string

__all__ = [
    "ArchConfig",
    "CanonicalTensor",
    "InferParallel",
    "MlaConfig",
    "ModelSpec",
    "MoeConfig",
    "TrainParallel",
    "arch_from_hf_config",
    "canonical_tensors",
    "load_model_spec",
    "parse_parallel_string",
    "preset_configs",
    "spec_from_hf_config",
]
