"""NeMo RL's configuration in our terms: the ``refit:`` block and both sides' parallelism.

A NeMo RL GRPO config (``MasterConfig``, plain dicts) names the Megatron policy's
parallel sizes under ``policy.megatron_cfg`` and vLLM's under
``policy.generation.vllm_cfg``; the cluster sizes come from the worker groups. These
functions read them into :class:`TrainParallel` / :class:`InferParallel` and refuse,
naming the key, what the refit cannot serve. Nothing here imports NeMo RL.

Our own block sits at the top level of the YAML (``MasterConfig`` keeps extra keys)::

    refit:
      backend: reshard        # reshard | nccl | nccl_reshard (NeMo RL's own refits)
      transport: cupy-nccl    # cupy-nccl | gloo
      timeout_s: 600
      bucket_mb: 512
      host: null              # the refit group's rendezvous IP (default: node IP)
      make_vocab_size_divisible_by: 128   # Megatron-Bridge's vocabulary padding
      delta: false            # reshard only: each message in its smallest form
      delta_anchor_every: 0   # with delta: a dense refit every that many versions
      delta_baseline: auto    # with delta: baselines on the GPU where they fit, device, host
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ...engine.delta import BASELINE_PLACES, DeltaOptions
from ...engine.transport import DEFAULT_TIMEOUT_S
from ...spec.parallel import InferParallel, TrainParallel
from ..worker import TRANSPORTS
from .errors import NemoRlConfigError
from .fp8 import check_fp8
from .sglang_config import check_sglang_generation

REFIT_BACKENDS = ("reshard", "nccl", "nccl_reshard")
GENERATION_BACKENDS = ("vllm", "sglang")


def _choose(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise NemoRlConfigError(f"{key}={value!r} is not one of {', '.join(choices)}")
    return str(value)


def _positive(key: str, value: Any, integer: bool = True) -> Any:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or value <= 0:
        kind = "a positive integer" if integer else "a positive number"
        raise NemoRlConfigError(f"{key}={value!r} must be {kind}")
    return value


@dataclass(frozen=True)
class RefitConfig:
    """The ``refit:`` block (see the module docstring)."""

    backend: str = "nccl"
    transport: str = "cupy-nccl"
    timeout_s: float = DEFAULT_TIMEOUT_S
    bucket_mb: float = 512
    host: str | None = None
    make_vocab_size_divisible_by: int = 128
    delta: bool = False  # delta refit (engine/delta/program.py), on every rank of the group
    delta_anchor_every: int = 0  # a dense refit every that many versions (0: only needed)
    delta_baseline: str = "auto"  # where senders keep their baselines: auto | device | host

    @classmethod
    def from_config(cls, block: Mapping[str, Any] | None) -> RefitConfig:
        """Validate ``refit:``; an unknown key or value is a :class:`NemoRlConfigError`."""
        block = dict(block or {})
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(block) - set(known))
        if unknown:
            raise NemoRlConfigError(
                f"refit has unknown key(s) {unknown}; known: {', '.join(known)}"
            )
        cfg = cls(**block)
        _choose("refit.backend", cfg.backend, REFIT_BACKENDS)
        _choose("refit.transport", cfg.transport, TRANSPORTS)
        _positive("refit.timeout_s", cfg.timeout_s, integer=False)
        _positive("refit.bucket_mb", cfg.bucket_mb, integer=False)
        _positive("refit.make_vocab_size_divisible_by", cfg.make_vocab_size_divisible_by)
        cfg.delta_options  # noqa: B018 - validates the delta keys
        return cfg

    @property
    def delta_options(self) -> DeltaOptions | None:
        """What the refit group's endpoint carries to every rank: None for a dense refit;
        a delta key set without ``delta: true``, or delta with another backend, is an
        error (never ignored)."""
        anchor, baseline = self.delta_anchor_every, self.delta_baseline
        if not isinstance(self.delta, bool):
            raise NemoRlConfigError(f"refit.delta={self.delta!r} must be true or false")
        if not isinstance(anchor, int) or isinstance(anchor, bool) or anchor < 0:
            raise NemoRlConfigError(f"refit.delta_anchor_every={anchor!r} must be an integer >= 0")
        _choose("refit.delta_baseline", baseline, BASELINE_PLACES)
        if not self.delta:
            set_ = [f"{k}={v!r}" for k, v, d in (
                ("delta_anchor_every", anchor, 0), ("delta_baseline", baseline, "auto")
            ) if v != d]  # fmt: skip
            if set_:
                raise NemoRlConfigError(
                    f"refit.{', refit.'.join(set_)} applies to delta refits only; set "
                    "refit.delta=true, or drop it"
                )
            return None
        if self.backend != "reshard":
            raise NemoRlConfigError(
                f"refit.delta=true needs refit.backend=reshard (delta refit sends the "
                f"reshard plan's messages in their smallest form; NeMo RL's "
                f"{self.backend} refit sends whole tensors); set refit.backend=reshard, or "
                "refit.delta=false"
            )
        return DeltaOptions(anchor_every=anchor, baseline=baseline)


def _size(cfg: Mapping[str, Any], where: str, key: str) -> int:
    value = cfg.get(key)
    return 1 if value is None else _positive(f"{where}.{key}", value)


def check_megatron(policy: Mapping[str, Any]) -> Mapping[str, Any]:
    """``policy.megatron_cfg``, which ``reshard`` needs enabled (it sends Megatron's
    local shards); returns it."""
    mcfg = policy.get("megatron_cfg") or {}
    if not mcfg.get("enabled", False):
        raise NemoRlConfigError(
            f"policy.megatron_cfg.enabled={mcfg.get('enabled')!r}: refit.backend=reshard "
            "needs the Megatron policy (set policy.megatron_cfg.enabled=true)"
        )
    # Pipeline splits our Megatron layout does not model (it models even splits and
    # num_layers_in_{first,last}_pipeline_stage).
    for key in (
        "pipeline_model_parallel_layout",
        "account_for_embedding_in_pipeline_split",
        "account_for_loss_in_pipeline_split",
    ):
        if mcfg.get(key):
            raise NemoRlConfigError(
                f"policy.megatron_cfg.{key}={mcfg[key]!r}: refit.backend=reshard models "
                "even pipeline splits and num_layers_in_first/last_pipeline_stage only; "
                "unset it"
            )
    return mcfg


def train_parallel(policy: Mapping[str, Any], world_size: int) -> TrainParallel:
    """Megatron's sizes from ``policy.megatron_cfg`` and the training world size.

    ``dp = world / (tp·pp·cp)``; VPP from ``virtual_pipeline_model_parallel_size`` when
    the config sets it. Megatron's own rules (``etp·ep·edp = tp·cp·dp``) are checked.
    """
    where = "policy.megatron_cfg"
    mcfg = check_megatron(policy)
    tp = _size(mcfg, where, "tensor_model_parallel_size")
    pp = _size(mcfg, where, "pipeline_model_parallel_size")
    cp = _size(mcfg, where, "context_parallel_size")
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise NemoRlConfigError(
            f"{where}: tp·pp·cp = {tp}·{pp}·{cp} = {model_parallel} does not divide the "
            f"{world_size} training GPUs"
        )
    etp = mcfg.get("expert_tensor_parallel_size")
    try:
        return TrainParallel(
            tp=tp,
            pp=pp,
            vpp=_size(mcfg, where, "virtual_pipeline_model_parallel_size"),
            cp=cp,
            dp=world_size // model_parallel,
            ep=_size(mcfg, where, "expert_model_parallel_size"),
            etp=None if etp is None else _positive(f"{where}.expert_tensor_parallel_size", etp),
        )
    except ValueError as err:
        raise NemoRlConfigError(f"{where}: {err}") from None


def colocated(generation: Mapping[str, Any]) -> bool:
    """``policy.generation.colocated.enabled`` (NeMo RL's default: true): training and
    generation on the same GPUs, each vLLM worker on a Megatron rank's GPU."""
    return bool((generation.get("colocated") or {}).get("enabled", True))


def check_generation(generation: Mapping[str, Any]) -> None:
    """``policy.generation`` as ``reshard`` needs it: vLLM (colocated or not, unquantized
    or block FP8: ``fp8.py``) or SGLang (``sglang_config.py``), no other refit transport."""
    where = "policy.generation"
    backend = generation.get("backend", "vllm")
    if backend not in GENERATION_BACKENDS:
        raise NemoRlConfigError(
            f"{where}.backend={backend!r}: refit.backend=reshard serves "
            f"{' and '.join(GENERATION_BACKENDS)} generation only"
        )
    transport = generation.get("refit_transport")
    if transport is not None:
        raise NemoRlConfigError(
            f"{where}.refit_transport={transport!r}: refit.backend=reshard replaces NeMo "
            "RL's refit transports; set it to null"
        )
    if backend == "sglang":
        check_sglang_generation(generation)
        return
    vcfg = generation.get("vllm_cfg") or {}
    if vcfg.get("precision") == "fp8":
        check_fp8(vcfg)
    else:
        precision(vcfg, "precision", f"{where}.vllm_cfg")


def infer_parallel(generation: Mapping[str, Any], world_size: int) -> InferParallel:
    """vLLM's sizes from ``policy.generation.vllm_cfg`` and the inference world size.

    NeMo RL runs one vLLM engine per ``tp·pp`` GPUs; with ``expert_parallel_size``
    above ``tp`` it groups ``ep/tp`` of them into one vLLM data-parallel engine (vLLM's
    EP = DP·TP), so ``engine_dp = ep/tp`` and ``dp`` counts those groups.
    """
    where = "policy.generation"
    check_generation(generation)
    vcfg = generation.get("vllm_cfg") or {}
    tp = _size(vcfg, f"{where}.vllm_cfg", "tensor_parallel_size")
    pp = _size(vcfg, f"{where}.vllm_cfg", "pipeline_parallel_size")
    ep = _size(vcfg, f"{where}.vllm_cfg", "expert_parallel_size")
    if ep > 1 and ep % tp:
        raise NemoRlConfigError(
            f"{where}.vllm_cfg.expert_parallel_size={ep} must be a multiple of "
            f"tensor_parallel_size={tp} (vLLM's EP = DP·TP)"
        )
    engine_dp = ep // tp if ep > tp else 1
    group = engine_dp * pp * tp
    if world_size % group:
        raise NemoRlConfigError(
            f"{where}.vllm_cfg: one engine group spans ep/tp·pp·tp = {group} GPUs, which "
            f"does not divide the {world_size} inference GPUs"
        )
    return InferParallel(tp=tp, pp=pp, dp=world_size // group, engine_dp=engine_dp, ep=ep)


def precision(cfg: Mapping[str, Any], key: str, where: str) -> str | None:
    """A NeMo RL ``precision`` value as a torch dtype name; None for ``auto`` (the
    checkpoint's dtype, as vLLM takes it) and for vLLM's ``fp8`` (its unquantized
    tensors in the checkpoint's dtype; ``fp8.py``)."""
    value = cfg.get(key, "bfloat16")
    if value in (None, "auto") or (value == "fp8" and key == "precision"):
        return None
    names = {
        "bfloat16": "bfloat16",
        "bf16": "bfloat16",
        "float16": "float16",
        "fp16": "float16",
        "float32": "float32",
        "fp32": "float32",
    }
    if value not in names:
        raise NemoRlConfigError(
            f"{where}.{key}={value!r} is not one of {', '.join(sorted(set(names.values())))}"
            " (or fp8 for vllm_cfg.precision)"
        )
    return names[value]
