"""What a local refit run is: the model, both parallelisms, the backends to time and how,
and the layouts on both sides of the refit that it describes."""

from __future__ import annotations

from dataclasses import dataclass

from ..layouts import MegatronOptions, RankLayout, VllmOptions, refit_layouts, vllm_layouts
from ..spec import InferParallel, ModelSpec, TrainParallel, load_model_spec


@dataclass
class RunConfig:
    """One local refit run (``demo``, ``bench``, tests, benchmarks): Megatron training
    ranks refit into vLLM (or SGLang) inference ranks, every rank a process on this machine. It
    travels to the ranks as JSON, so every field is a plain value."""

    model: str = "small-qwen3"
    train: str = "tp=2,pp=2"
    infer: str = "tp=2,dp=2"
    backends: tuple[str, ...] = ("reshard", "broadcast")
    steps: int = 3
    bucket_mb: float = 512
    relay: str = "none"  # "chain": forward between inference replicas
    timeout_s: float = 600
    seed: int = 0
    train_dtype: str | None = None  # e.g. "float32" master weights; default checkpoint dtype
    first_stage_layers: int | None = None  # Megatron num_layers_in_first_pipeline_stage
    last_stage_layers: int | None = None  # Megatron num_layers_in_last_pipeline_stage
    infer_dtype: str | None = None
    infer_engine: str = "vllm"  # or "sglang": whose layouts the inference ranks hold
    verify: bool = True
    transport: str = "gloo"  # or "cupy-nccl" (one GPU per rank, round robin over devices)
    kill_rank: int | None = None  # fault injection: this group rank dies ...
    kill_step: int = 0  # ... at the start of this step of the first backend (-1: at start-up)
    overlap: bool | None = None  # overlapped replay (engine/pipeline.py); None: CUDA only
    device: str = "cpu"  # gloo ranks' tensors: "cpu", or "cuda" (through pinned copies)
    host_staged: bool | None = None  # gloo through pinned copies; None: when device is cuda
    connect_timeout_s: float | None = None  # rendezvous; None: run_local's join timeout
    colocated: bool = False  # also run the colocated refit (runner/colocated.py)
    # Block-FP8 engines: training ranks send e4m3 + scales where they hold whole blocks
    # (layouts/fp8_wire.py); False: everything in the trained dtype, quantized on arrival.
    fp8_on_wire: bool = True
    # Delta refit (engine/delta/program.py): Adam steps at ``lr`` between refits, each message of
    # the reshard backend sent in its smallest form; a dense step every ``anchor_every``.
    delta: bool = False
    lr: float = 1e-6
    anchor_every: int = 0
    # how CPU ranks compare and apply (DeltaOptions.cpu_kernel: auto, numba, numpy)
    delta_kernel: str = "auto"
    # each delta's base checked against its receiver every step (DeltaOptions.check;
    # None: on for GPU ranks, off for CPU ones)
    delta_check: bool | None = None

    def parallel(self) -> tuple[TrainParallel, InferParallel]:
        """The training and inference parallelisms ``train`` and ``infer`` spell."""
        return TrainParallel.parse(self.train), InferParallel.parse(self.infer)


def build_layouts(cfg: RunConfig) -> tuple[ModelSpec, list[RankLayout], list[RankLayout]]:
    """``(spec, sources, destinations)``: the model and every training and inference
    rank's layout, in rank order, for the run ``cfg`` describes."""
    spec = load_model_spec(cfg.model)
    train, infer = cfg.parallel()
    megatron = MegatronOptions(
        params_dtype=cfg.train_dtype,
        num_layers_in_first_pipeline_stage=cfg.first_stage_layers,
        num_layers_in_last_pipeline_stage=cfg.last_stage_layers,
    )
    vllm = VllmOptions(params_dtype=cfg.infer_dtype)
    sources, destinations = refit_layouts(
        spec, train, infer, megatron, vllm, cfg.fp8_on_wire, cfg.infer_engine
    )
    return spec, sources, destinations


def fp8_destinations(cfg: RunConfig) -> list[RankLayout]:
    """A block-FP8 engine's own layouts (e4m3 weights and their scales): what its ranks
    hold (``build_layouts`` gives them as the wire carries them)."""
    spec = load_model_spec(cfg.model)
    _, infer = cfg.parallel()
    return vllm_layouts(spec, infer, VllmOptions(params_dtype=cfg.infer_dtype))
