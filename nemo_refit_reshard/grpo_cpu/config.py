"""The GRPO run's configuration: a typed, validated view of ``configs/grpo_cpu.yaml``.

:meth:`GrpoRunConfig.from_dict` takes the YAML's nested dict (Hydra's config after
``OmegaConf.to_container``), refuses unknown keys, and raises ``ValueError`` for values
the run cannot honour, before Ray or any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ..engine.delta import DeltaOptions
from ..engine.refit import BACKENDS
from ..layouts.megatron_rules import MegatronOptions, check_megatron_parallel
from ..layouts.vllm import check_vllm_parallel
from ..spec.model import spec_from_hf_config
from ..spec.parallel import InferParallel, TrainParallel
from .task import StringTask, policy_config
from .trainer import GrpoConfig

POLICIES = ("toy-qwen3",)  # the tiny Qwen3 of task.py: the only policy both sides run
INFER_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class RefitSettings:
    backend: str = "reshard"  # reshard | broadcast
    bucket_mb: float = 512.0
    timeout_s: float = 60.0  # a dead peer surfaces as an error within this
    verify: bool = False  # checksum every destination tensor after every refit
    compare_broadcast: bool = True  # also time the other backend each step
    delta: bool = False  # delta refit (engine/delta/program.py): each message in its smallest form
    delta_anchor_every: int = 0  # with delta: a dense refit every that many versions (0: never)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"unknown refit.backend {self.backend!r}; choose one of: {', '.join(BACKENDS)}"
            )
        if not self.bucket_mb > 0 or not self.timeout_s > 0:
            raise ValueError("refit.bucket_mb and refit.timeout_s must be > 0")
        self._check_delta()

    def _check_delta(self) -> None:
        """Delta refit is the reshard backend's, alone: refused by name otherwise."""
        if not isinstance(self.delta, bool):
            raise ValueError(f"refit.delta={self.delta!r} must be true or false")
        anchor = self.delta_anchor_every
        if not isinstance(anchor, int) or isinstance(anchor, bool) or anchor < 0:
            raise ValueError(f"refit.delta_anchor_every={anchor!r} must be an integer >= 0")
        if not self.delta:
            if anchor:
                raise ValueError(
                    f"refit.delta_anchor_every={anchor} applies to delta refits only; set "
                    "refit.delta: true, or drop refit.delta_anchor_every"
                )
            return
        if self.backend != "reshard":
            raise ValueError(
                f"refit.delta: true needs refit.backend: reshard (a delta refit sends the "
                f"reshard plan's messages in their smallest form; {self.backend!r} has no "
                "such messages); set refit.backend: reshard, or refit.delta: false"
            )
        if self.compare_broadcast:
            raise ValueError(
                "refit.delta: true with refit.compare_broadcast: true: the broadcast "
                "comparison would write every weight before the delta refit, whose receivers "
                "rebuild last step's messages from those weights, so the delta would go "
                "unchecked; set refit.compare_broadcast: false (the report compares the "
                "delta's bytes with the dense refit's)"
            )

    @property
    def delta_options(self) -> DeltaOptions | None:
        """What every refit endpoint carries: None for a dense refit."""
        return DeltaOptions(anchor_every=self.delta_anchor_every) if self.delta else None

    @property
    def backends(self) -> tuple[str, ...]:
        """Backends run each step, in order: the comparison first, the real refit last
        (so the generator always ends a step with the real backend's result)."""
        if not self.compare_broadcast:
            return (self.backend,)
        other = "broadcast" if self.backend == "reshard" else "reshard"
        return (other, self.backend)


@dataclass(frozen=True)
class RaySettings:
    num_cpus: int = 2  # ray.init(num_cpus=...) when the run starts Ray itself
    setup_timeout_s: float = 600.0  # actor start-up: imports, process groups, models
    call_timeout_s: float = 300.0  # one generate or train call
    log_to_driver: bool = False  # forward actor stdout/stderr (megatron is chatty)

    def __post_init__(self) -> None:
        if self.num_cpus < 1 or not self.setup_timeout_s > 0 or not self.call_timeout_s > 0:
            raise ValueError("ray.num_cpus must be >= 1 and the ray timeouts > 0")


@dataclass(frozen=True)
class FaultSettings:
    """Engines that come and go while the run trains (``grpo_cpu/elastic.py``).

    ``lose_engine_at_step=K``: generation engine ``engine`` (a replica) dies when the
    refit of step K starts; it is fenced and the others finish step K's refit.
    ``add_engine_at_step=M``: engine ``engine`` joins before step M generates — restarted
    if it was lost before M, else a new engine (the run then starts without it)."""

    lose_engine_at_step: int | None = None
    add_engine_at_step: int | None = None
    engine: int | None = None  # which replica; None: the last one (infer.dp - 1)

    @property
    def active(self) -> bool:
        return self.lose_engine_at_step is not None or self.add_engine_at_step is not None

    def engine_of(self, num_replicas: int) -> int:
        return num_replicas - 1 if self.engine is None else self.engine

    def starts_without_it(self) -> bool:
        """Whether the run starts without the engine (it joins as a new one)."""
        add, lose = self.add_engine_at_step, self.lose_engine_at_step
        return add is not None and (lose is None or lose >= add)


@dataclass(frozen=True)
class GrpoRunConfig:
    train: TrainParallel = field(default_factory=lambda: TrainParallel(tp=2))
    infer: InferParallel = field(default_factory=lambda: InferParallel(tp=2, dp=2))
    infer_dtype: str = "float32"
    policy: dict[str, Any] = field(default_factory=policy_config)  # HF config of the policy
    task: StringTask = field(default_factory=StringTask)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    num_steps: int = 20
    seed: int = 0
    refit: RefitSettings = field(default_factory=RefitSettings)
    ray: RaySettings = field(default_factory=RaySettings)
    faults: FaultSettings = field(default_factory=FaultSettings)
    progress: bool = True  # tqdm bar and one printed line per step
    # Test-only fault injection (never set by the YAML):
    test_only_drop_tensor: str | None = None  # remove this canonical tensor from the plans
    test_only_exit: tuple[int, int] | None = None  # (refit rank, step): it exits mid-refit

    def __post_init__(self) -> None:
        if self.infer.pp > 1 or self.infer.engine_dp > 1 or self.infer.ep > 1:
            raise ValueError(
                f"infer={self.infer}: the CPU generator runs tp and independent dp replicas "
                "only; set infer.tp and infer.dp"
            )
        if self.train.vpp > 1 or self.train.cp > 1 or self.train.ep > 1:
            raise ValueError(f"train={self.train}: the CPU trainer runs tp, pp and dp only")
        if self.infer_dtype not in INFER_DTYPES:
            raise ValueError(
                f"infer.dtype {self.infer_dtype!r} is not supported; choose one of {INFER_DTYPES}"
            )
        g = self.grpo
        if self.num_steps < 1 or g.group_size < 2 or g.prompts_per_step < 1:
            raise ValueError("need grpo.num_steps >= 1, group_size >= 2, prompts_per_step >= 1")
        if g.max_new_tokens != self.task.completion_len:
            raise ValueError(
                f"grpo.max_new_tokens={g.max_new_tokens} but the task scores exactly "
                f"model.length={self.task.completion_len} tokens; make them equal"
            )
        self._check_faults()
        out = (
            [("the generation replicas serving while an engine is out", self.infer.dp - 1)]
            if self.faults.active
            else []
        )
        for what, n in (
            ("infer.dp (generation replicas)", self.infer.dp),
            *out,
            ("train.dp", self.train.dp),
        ):
            if g.prompts_per_step % n:
                raise ValueError(
                    f"grpo.prompts_per_step={g.prompts_per_step} must split evenly over {what}={n}"
                )

    def _check_faults(self) -> None:
        f, dp = self.faults, self.infer.dp
        if not f.active:
            if f.engine is not None:
                raise ValueError(
                    "faults.engine applies with faults.lose_engine_at_step or "
                    "faults.add_engine_at_step; set one, or drop faults.engine"
                )
            return
        for key in ("lose_engine_at_step", "add_engine_at_step"):
            value = getattr(f, key)
            if value is not None and not 1 <= value <= self.num_steps:
                raise ValueError(
                    f"faults.{key}={value} must be a step of the run (1..{self.num_steps})"
                )
        if f.lose_engine_at_step is not None and f.lose_engine_at_step == f.add_engine_at_step:
            raise ValueError(
                f"faults.lose_engine_at_step and faults.add_engine_at_step are both "
                f"{f.add_engine_at_step}: the engine joins before that step generates and "
                "would die in its refit; choose different steps"
            )
        engine = f.engine_of(dp)
        if dp < 2 or not 0 <= engine < dp:
            raise ValueError(
                f"faults.engine={engine} with infer.dp={dp}: the run needs another engine "
                f"serving while it is out (infer.dp >= 2, faults.engine in 0..{dp - 1})"
            )
        r = self.refit
        if r.backend != "reshard" or r.compare_broadcast:
            # each group's plan is a reshard plan for its engines; no baseline is derived
            # (refit.verify is fine: each group's refits are checked over that group)
            raise ValueError(
                "faults: engines that come and go refit with the reshard backend only: set "
                "refit.backend: reshard, refit.compare_broadcast: false"
            )

    @property
    def num_replicas(self) -> int:
        return self.infer.dp

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> GrpoRunConfig:
        """Build from the YAML layout: ``model``, ``train``, ``infer``, ``grpo``, ``refit``,
        ``ray`` and ``progress`` (a ``hydra`` key, if present, is ignored)."""
        cfg = {k: v for k, v in cfg.items() if k != "hydra"}
        _known(cfg, {"model", "train", "infer", "grpo", "refit", "ray", "faults", "progress"}, "")
        model = dict(cfg.get("model") or {})
        sizes = {"hidden_size", "intermediate_size", "num_layers"}
        _known(model, {"policy", "task", "length", "alphabet", "init_std"} | sizes, "model.")
        policy = model.get("policy", POLICIES[0])
        if policy not in POLICIES:
            raise ValueError(f"unknown model.policy {policy!r}; choose one of {POLICIES}")
        hf = policy_config(
            **{
                ("num_hidden_layers" if k == "num_layers" else k): int(model[k])
                for k in sizes & set(model)
            }
        )
        task = StringTask(
            length=int(model.get("length", 4)),
            alphabet=str(model.get("alphabet", "abcd")),
            mode=str(model.get("task", "copy")),
        )
        train = dict(cfg.get("train") or {})
        _known(train, {"tp", "pp", "dp"}, "train.")
        infer = dict(cfg.get("infer") or {})
        _known(infer, {"tp", "dp", "dtype"}, "infer.")
        dtype = str(infer.pop("dtype", "float32"))
        grpo = dict(cfg.get("grpo") or {})
        hyper = {"prompts_per_step", "group_size", "lr", "clip_eps", "kl_coef"}
        hyper |= {"max_new_tokens", "temperature", "max_grad_norm"}
        _known(grpo, hyper | {"num_steps", "seed"}, "grpo.")
        num_steps = _typed("grpo.num_steps", grpo.pop("num_steps", 20), int)
        seed = _typed("grpo.seed", grpo.pop("seed", 0), int)
        defaults = GrpoConfig()
        for key, value in grpo.items():
            kind = type(getattr(defaults, key))
            if kind in (int, float) and value is not None:
                grpo[key] = _typed(f"grpo.{key}", value, kind)
        trainer_cfg = GrpoConfig(
            **grpo,
            init_std=float(model.get("init_std", 0.02)),
            rope_theta=float(hf["rope_theta"]),
            rms_norm_eps=float(hf["rms_norm_eps"]),
        )
        refit = dict(cfg.get("refit") or {})
        _known(refit, {f.name for f in fields(RefitSettings)}, "refit.")
        ray = dict(cfg.get("ray") or {})
        _known(ray, {f.name for f in fields(RaySettings)}, "ray.")
        faults = dict(cfg.get("faults") or {})
        _known(faults, {f.name for f in fields(FaultSettings)}, "faults.")
        faults = {
            k: None if v is None else _typed(f"faults.{k}", v, int) for k, v in faults.items()
        }
        train_par = TrainParallel.parse(_parallel_string(train))
        infer_par = InferParallel.parse(_parallel_string(infer))
        _check_parallel(hf, train_par, infer_par)
        return cls(
            train=train_par,
            infer=infer_par,
            infer_dtype=dtype,
            policy=hf,
            task=task,
            grpo=trainer_cfg,
            num_steps=num_steps,
            seed=seed,
            refit=RefitSettings(**refit),
            ray=RaySettings(**ray),
            faults=FaultSettings(**faults),
            progress=bool(cfg.get("progress", True)),
        )


def _known(section: dict[str, Any], allowed: set[str], prefix: str) -> None:
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise ValueError(
            f"unknown config key(s) {', '.join(prefix + k for k in unknown)}; valid: "
            f"{', '.join(prefix + k for k in sorted(allowed))}"
        )


def _typed(key: str, value: Any, kind: type) -> Any:
    try:
        return kind(value)
    except (TypeError, ValueError):
        name = "an integer" if kind is int else "a number"
        raise ValueError(f"{key}={value!r} must be {name}") from None


def _check_parallel(hf: dict[str, Any], train: TrainParallel, infer: InferParallel) -> None:
    """Both sides' parallelism against the policy's shapes, before any actor starts."""
    arch = spec_from_hf_config(hf).arch
    for side, par, check in (
        ("train", train, lambda: check_megatron_parallel(arch, train, MegatronOptions())),
        ("infer", infer, lambda: check_vllm_parallel(arch, infer)),
    ):
        try:
            check()
        except ValueError as err:
            raise ValueError(f"{side} ({par}): {err}") from None


def _parallel_string(section: dict[str, Any]) -> str:
    # Through the parallelism grammar, so bad values get the repo's usual parse errors.
    return ",".join(f"{k}={v}" for k, v in section.items())


__all__ = ["FaultSettings", "GrpoRunConfig", "RaySettings", "RefitSettings"]
