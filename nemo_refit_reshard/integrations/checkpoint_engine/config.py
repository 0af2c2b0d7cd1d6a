"""The checkpoint engine's settings, the model they name, and the settings every
worker must agree on (the veRL and NeMo RL engines read them from their framework's
config; the driver plans with the one text every worker reported)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from ...engine.delta import BASELINE_PLACES, DeltaOptions
from ...spec import ModelSpec, load_model_spec
from ..worker import TRANSPORTS

MODES = ("reshard", "broadcast")
QUANTIZATIONS = ("fp8",)
INFER_ENGINES = ("vllm", "sglang")  # whose shard layouts the rollout GPUs hold


@dataclass(frozen=True)
class ReshardEngineConfig:
    """The engine's settings (veRL: ``checkpoint_engine.engine_kwargs.reshard``; NeMo RL:
    ``policy.generation.refit_cfg["<module>:<Class>"]``).

    ``model``: HF model directory (or its config.json, or a preset name).
    ``infer``: one rollout replica's parallelism, ``tp=,pp=,engine_dp=,ep=``; the
    number of replicas follows from the rollout world size. ``infer_engine``: the
    rollout's engine, ``vllm`` or ``sglang`` (veRL: the same as ``rollout.name``), whose
    shard layouts the plan delivers. ``train_dtype``: dtype of
    the tensors the actor yields; ``infer_dtype``: vLLM's parameter dtype (both default
    to the checkpoint's). ``transport``: ``gloo`` (CPU) or ``cupy-nccl`` (GPUs).
    ``bucket_mb``: bytes per round (default: ``update_weights_bucket_megabytes``).
    ``quantization``: ``fp8`` when the rollout serves the trained weights as 128×128
    block FP8, quantizing what it loads (veRL's ``rollout.quantization: fp8``); default:
    the checkpoint's own ``quantization_config``. The wire carries the trained dtype
    either way (what the rollout's loader takes); it only adds vLLM's block rules.
    ``delta``: send each message of the plan in its smallest form (``engine/delta/program.py``;
    mode ``reshard`` only), with ``delta_anchor_every`` (a dense update every that many
    versions; 0: only when needed) and ``delta_baseline`` (``auto``, ``device`` or ``host``:
    where the actor ranks keep the copy of what they sent last; ``auto``: the GPU where it
    fits, ``engine/delta/options.choose_baseline_place``).
    """

    model: str
    infer: str = "tp=1"
    infer_engine: str = "vllm"
    train_dtype: str | None = None
    infer_dtype: str | None = None
    vllm_version: str | None = None
    transport: str = "gloo"
    timeout_s: float = 600.0
    bucket_mb: float | None = None
    host: str | None = None  # the IP hosting the refit group's store (None: the node's)
    mode: str = "reshard"  # or "broadcast": the gather-broadcast baseline, for comparison
    quantization: str | None = None
    delta: bool = False
    delta_anchor_every: int = 0
    delta_baseline: str = "auto"

    @classmethod
    def from_engine_kwargs(
        cls,
        kwargs: Mapping[str, Any],
        bucket_size: int,
        where: str = "checkpoint_engine.engine_kwargs.reshard",
        infer_engines: tuple[str, ...] = INFER_ENGINES,
    ) -> ReshardEngineConfig:
        """``where`` names the settings' place in the framework's config, for errors;
        ``infer_engines``: the rollout engines the framework's route can serve."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"{where} has unknown key(s) {unknown}; known: {sorted(known)}")
        if "model" not in kwargs:
            raise ValueError(
                f"{where}.model is required: the HF model path (the policy's model) or a "
                "preset name"
            )
        config = cls(**kwargs)
        if config.transport not in TRANSPORTS:
            raise ValueError(f"{where}.transport={config.transport!r}; choose from {TRANSPORTS}")
        if config.mode not in MODES:
            raise ValueError(f"{where}.mode={config.mode!r}; choose from {MODES}")
        if config.infer_engine not in INFER_ENGINES:
            raise ValueError(
                f"{where}.infer_engine={config.infer_engine!r}; choose from {INFER_ENGINES} "
                "(the rollout's engine: veRL's rollout.name)"
            )
        if config.infer_engine not in infer_engines:
            raise ValueError(
                f"{where}.infer_engine={config.infer_engine!r}: this route serves "
                f"{' and '.join(infer_engines)} rollouts only; leave infer_engine unset"
            )
        if config.infer_engine == "sglang" and config.quantization is not None:
            raise ValueError(
                f"{where}.quantization={config.quantization!r} with infer_engine sglang: FP8 "
                "SGLang rollouts are not covered (the FP8 shard checks are vLLM's); serve "
                "BF16 weights, or use a vLLM rollout"
            )
        if config.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(
                f"{where}.quantization={config.quantization!r}: the checkpoint engine serves "
                f"rollouts that quantize at load to {QUANTIZATIONS} (veRL's "
                "rollout.quantization); leave it unset for an unquantized rollout"
            )
        config.delta_options_at(where)  # refuses a bad delta key
        if config.bucket_mb is None:
            config = dataclasses.replace(config, bucket_mb=bucket_size / 2**20)
        return config

    @property
    def delta_options(self) -> DeltaOptions | None:
        """The refit group's delta options (every rank's endpoint carries them); None:
        dense."""
        return self.delta_options_at("the engine's settings")

    def delta_options_at(self, where: str) -> DeltaOptions | None:
        """:attr:`delta_options`, refusing (naming ``where``) a non-boolean ``delta``, a
        delta key without ``delta: true``, a bad anchor or baseline, or delta with mode
        ``broadcast`` (the baseline moves whole tensors: nothing to patch)."""
        anchor, baseline = self.delta_anchor_every, self.delta_baseline
        if not isinstance(self.delta, bool):
            raise ValueError(f"{where}.delta={self.delta!r} must be true or false")
        if isinstance(anchor, bool) or not isinstance(anchor, int) or anchor < 0:
            raise ValueError(f"{where}.delta_anchor_every={anchor!r} must be an integer >= 0")
        if baseline not in BASELINE_PLACES:
            raise ValueError(
                f"{where}.delta_baseline={baseline!r}; choose from {list(BASELINE_PLACES)}"
            )
        if not self.delta:
            defaults = {"delta_anchor_every": (anchor, 0), "delta_baseline": (baseline, "auto")}
            set_ = [key for key, (value, default) in defaults.items() if value != default]
            if set_:
                raise ValueError(
                    f"{where}.{set_[0]} applies to delta refits only; set {where}.delta: "
                    "true, or drop it"
                )
            return None
        if self.mode != "reshard":
            raise ValueError(
                f"{where}.delta: true needs mode reshard (delta refit patches the plan's "
                f"messages; mode {self.mode!r} sends whole tensors); drop delta or mode"
            )
        return DeltaOptions(anchor_every=anchor, baseline=baseline)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def engine_spec(model: str) -> ModelSpec:
    """The model the engine plans for: a preset, a ``config.json`` path or folder, or a
    HuggingFace repo id (its ``config.json`` through the local HuggingFace cache, as the
    framework itself loaded the model)."""
    try:
        return load_model_spec(model)
    except ValueError as err:
        if model.count("/") != 1 or model.startswith((".", "/")):
            raise
        try:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(model, "config.json")
        except Exception as hub_err:
            raise ValueError(f"{err}; as a HuggingFace repo id: {hub_err}") from None
        return load_model_spec(path)


def check_same_settings(metadata: Iterable[Mapping[str, Any]], where: str) -> str:
    """The one settings text every worker reported, or an error naming the disagreement."""
    configs = {m["config"] for m in metadata}
    if len(configs) != 1:
        raise ValueError(
            f"{where} differs between training and rollout workers ({len(configs)} "
            "variants); give every worker the same settings"
        )
    return next(iter(configs))


def planning_settings(text: str, rollout_metadata: Iterable[Mapping[str, Any]]) -> str:
    """The settings to plan with: unless ``vllm_version`` is set, the vLLM version the
    rollout workers run (training workers may not have vLLM at all, or another one)."""
    settings = json.loads(text)
    if settings.get("vllm_version"):
        return text
    versions = {m.get("vllm") for m in rollout_metadata} - {None}
    if len(versions) > 1:
        raise ValueError(
            f"rollout workers run different vLLM versions {sorted(versions)}; run one, or set "
            "the engine's vllm_version"
        )
    if versions:
        settings["vllm_version"] = versions.pop()
    return json.dumps(settings, sort_keys=True)
