"""Plan a NeMo RL refit once, on the driver, from its config and its workers' reports.

Sizes come from NeMo RL's config (``config.py``); the workers' reports
(``reshard_describe`` on every Megatron policy worker, ``refit_describe`` in every
vLLM worker) confirm them and supply what only the live model knows (the layer spec,
grouped GEMM, dtypes, the vLLM version). Every disagreement — a rank whose
``parallel_state`` position is not the one planned, a live tensor the layout lacks or
shapes differently — is a :class:`PlanError` listing all of them, raised before any
group is joined. Nothing here imports NeMo RL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ...layouts import (
    MegatronOptions,
    RankLayout,
    VllmOptions,
    megatron_layouts,
    megatron_position,
    refit_layouts,
)
from ...layouts.fp8_wire import live_tensors
from ...plan import Colocation, PlanError, RefitPlan, plan_refit, rank_plan
from ...spec.parallel import InferParallel, TrainParallel
from ..checkpoint_engine import engine_spec
from ..megatron.live import UNKNOWABLE_OPTIONS
from .config import RefitConfig, colocated, infer_parallel, precision, train_parallel
from .fp8 import fp8_spec
from .sglang_config import sglang_infer_parallel


@dataclass(frozen=True)
class NemoRlPlan:
    """The plan, both sides' parallelism, and each refit rank's slice as JSON."""

    plan: RefitPlan
    train: TrainParallel
    infer: InferParallel
    slices: tuple[str, ...]  # refit rank r: policy rank r < T, vLLM rank r - T
    engine: str = "vLLM"  # the inference engine, as the plan's title names it

    @property
    def num_policy(self) -> int:
        return self.train.world_size

    @property
    def colocated(self) -> bool:
        return bool(self.plan.colocated_hosts)

    def engine_slices(self, first_rank: int, size: int) -> dict[str, str]:
        """The slices of refit ranks ``first_rank .. first_rank+size-1``, by rank."""
        return {str(r): self.slices[r] for r in range(first_rank, first_rank + size)}

    def host_slices(self, rank: int) -> dict[str, str]:
        """Colocated: policy rank ``rank``'s slice and its guest's (the vLLM worker on its
        GPU, if any), by refit rank."""
        t = self.num_policy
        out = {str(rank): self.slices[rank]}
        guest = Colocation(self.plan.colocated_hosts).guest_of(rank, t)
        if guest is not None:
            out[str(guest)] = self.slices[guest]
        return out

    def __str__(self) -> str:
        s = self.plan.stats
        text = (
            f"reshard plan {self.plan.fingerprint[:12]}: Megatron {self.train} -> {self.engine} "
            f"{self.infer}, {s.total_bytes / 2**20:,.1f} MiB per refit in "
            f"{s.num_rounds} rounds"
        )
        if s.bytes_by_dtype:  # a block-FP8 vLLM engine (layouts/fp8_wire.py)
            wire = ", ".join(f"{n / 2**20:,.1f} MiB {d}" for d, n in s.bytes_by_dtype)
            text += f"; on the wire: {wire}"
        if self.colocated:
            b = self.plan.colocated_bytes()
            text += (
                f"; colocated: {b.network / 2**20:,.1f} MiB between GPUs, "
                f"{b.local / 2**20:,.1f} MiB copied on the GPU"
            )
        return text


def _tensor_problems(layout: RankLayout, report: Mapping[str, Any]) -> list[str]:
    """Layout vs a worker's reported tensors (``describe_tensors``) and parameters."""
    want = {n: [list(shape), dtype] for n, (shape, dtype) in live_tensors(layout).items()}
    have = report["tensors"]
    problems = [f"{n}: in the layout, not live" for n in sorted(set(want) - set(have))]
    problems += [
        f"{n}: a live parameter the layout does not cover"
        for n in report.get("parameters", have)
        if n not in want
    ]
    problems += [
        f"{n}: live {have[n][0]} {have[n][1]}, the layout has {want[n][0]} {want[n][1]}"
        for n in sorted(set(want) & set(have))
        if list(have[n][0]) != want[n][0] or have[n][1] != want[n][1]
    ]
    return problems


def _same(reports: Sequence[Mapping[str, Any]], key: str, who: str) -> Any:
    values = {repr(r[key]): r[key] for r in reports}
    if len(values) != 1:
        raise PlanError(f"{who} disagree on {key}: {sorted(values)}")
    return next(iter(values.values()))


def megatron_options(
    train: TrainParallel, refit: RefitConfig, reports: Sequence[Mapping[str, Any]]
) -> MegatronOptions:
    """The Megatron layout options the policy workers report (they must agree), with the
    vocabulary padding from the refit block; the reports must be ranks ``0..T-1``."""
    ranks = [int(r["rank"]) for r in reports]
    if ranks != list(range(train.world_size)):
        raise PlanError(
            f"policy workers report ranks {ranks}; the config gives {train} = "
            f"{train.world_size} ranks 0..{train.world_size - 1}"
        )
    live = settle_options(reports)
    return MegatronOptions(make_vocab_size_divisible_by=refit.make_vocab_size_divisible_by, **live)


def settle_options(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The layout options of the model, settled once from every policy rank's report
    (``live_megatron_options``): a rank that cannot tell an option (None for one in
    ``UNKNOWABLE_OPTIONS``: a pipeline stage without experts, without decoder layers)
    abstains; every other rank must report the same value. An option no rank can tell
    keeps ``MegatronOptions``' default (the model has no such layers). A disagreement
    is one line per option naming the ranks of each value."""
    keys = sorted({k for r in reports for k in r["options"]})
    settled: dict[str, Any] = {}
    problems = []
    for key in keys:
        ranks: dict[str, list[int]] = {}
        values: dict[str, Any] = {}
        for r in reports:
            value = r["options"].get(key)
            if value is None and key in UNKNOWABLE_OPTIONS:
                continue
            ranks.setdefault(repr(value), []).append(int(r["rank"]))
            values[repr(value)] = value
        if len(values) > 1:
            detail = "; ".join(f"ranks {rs}: {v}" for v, rs in sorted(ranks.items()))
            problems.append(f"policy workers disagree on {key} ({detail})")
        elif values:
            settled[key] = next(iter(values.values()))
    if problems:
        raise PlanError(
            "; ".join(problems) + ": every rank must run one model and training config "
            "(policy.megatron_cfg)"
        )
    return settled


def check_megatron_sources(
    layouts: Sequence[RankLayout],
    train: TrainParallel,
    opts: MegatronOptions,
    reports: Sequence[Mapping[str, Any]],
) -> None:
    """Every policy rank's reported ``parallel_state`` position and live tensors against
    its planned layout; one :class:`PlanError` listing every disagreement."""
    sizes = {
        "tp": train.tp, "pp": train.pp, "vpp": train.vpp, "cp": train.cp,
        "dp": train.dp, "ep": train.ep, "etp": train.expert_tp,
    }  # fmt: skip
    problems = []
    for r, report in enumerate(reports):
        pos = report["position"]
        want = megatron_position(train, r).as_dict()
        wrong = [f"{k}={pos[k]} (planned {v})" for k, v in want.items() if pos[k] != v]
        wrong += [
            f"{k}_size={pos[f'{k}_size']} (config {v})"
            for k, v in sizes.items()
            if pos[f"{k}_size"] != v
        ]
        if wrong:  # a rank elsewhere than planned: its tensors are not comparable
            problems.append(f"rank {r}: " + ", ".join(wrong))
            continue
        problems += [f"rank {r}: {p}" for p in _tensor_problems(layouts[r], report)]
    if problems:
        raise PlanError.listing(
            f"Megatron policy workers do not match the planned layout {train} ({opts})",
            problems,
            "check policy.megatron_cfg (parallel sizes) and refit.make_vocab_size_divisible_by",
        )


def megatron_sources(
    spec: Any, train: TrainParallel, refit: RefitConfig, reports: Sequence[Mapping[str, Any]]
) -> list[RankLayout]:
    """Every policy rank's layout, checked against its report."""
    opts = megatron_options(train, refit, reports)
    layouts = megatron_layouts(spec, train, opts)
    check_megatron_sources(layouts, train, opts, reports)
    return layouts


def vllm_options(dtype: str, engines: Sequence[Sequence[Mapping[str, Any]]]) -> VllmOptions:
    """The vLLM layout options the vLLM engines' workers report (they must agree), with the
    parameter dtype from NeMo RL's config."""
    flat = [w for engine in engines for w in engine]
    version = _same(flat, "vllm_version", "vLLM workers")
    all2all = _same(flat, "all2all_backend", "vLLM workers")
    return VllmOptions(params_dtype=dtype, vllm_version=version, all2all_backend=all2all)


def check_vllm_destinations(
    layouts: Sequence[RankLayout],
    infer: InferParallel,
    opts: VllmOptions,
    engines: Sequence[Sequence[Mapping[str, Any]]],
) -> None:
    """Every vLLM rank's layout against the reports of each vLLM engine's workers
    (``engines[i]``: NeMo RL's vLLM engine ``i``, its workers in vLLM's order)."""
    engine_par = str(replace(infer, dp=1))
    size = infer.tp * infer.pp
    problems = []
    for i, engine in enumerate(engines):
        if len(engine) != size:
            problems.append(f"engine {i}: {len(engine)} workers, the config gives tp·pp={size}")
            continue
        for w in engine:
            d = (i // infer.engine_dp) * infer.engine_world_size + int(w["engine_rank"])
            if w["parallel"] != engine_par:
                problems.append(f"engine {i}: runs {w['parallel']}, the config gives {engine_par}")
                break
            problems += [f"vLLM rank {d}: {p}" for p in _tensor_problems(layouts[d], w)]
    if problems:
        raise PlanError.listing(
            f"vLLM {opts.vllm_version} engines do not match the planned layout {infer}",
            problems,
            "check policy.generation.vllm_cfg against the running engines",
        )


def colocation(
    infer: InferParallel,
    policy_reports: Sequence[Mapping[str, Any]],
    engines: Sequence[Sequence[Mapping[str, Any]]],
) -> Colocation:
    """Which policy rank shares each vLLM rank's GPU, from the GPUs the workers report
    (``device_name``: hostname and GPU UUID). A GPU with two policy ranks or two vLLM
    workers, or a vLLM worker with no policy rank on its GPU, is refused with one line."""
    unnamed = [f"policy rank {r['rank']}" for r in policy_reports if not r.get("gpu")]
    train = [str(r.get("gpu")) for r in policy_reports]
    gpus: dict[int, str] = {}
    for i, engine in enumerate(engines):
        for w in engine:
            d = (i // infer.engine_dp) * infer.engine_world_size + int(w["engine_rank"])
            if not w.get("gpu"):
                unnamed.append(f"vLLM rank {d}")
            gpus[d] = str(w.get("gpu"))
    if unnamed:
        raise PlanError(
            f"colocated refit: {', '.join(unnamed)} report no GPU (a CPU process names the "
            "GPU it stands for in $NRR_DEVICE)"
        )
    return Colocation.from_devices(train, [gpus[d] for d in sorted(gpus)])


def plan_nemo_rl(
    master_config: Mapping[str, Any],
    refit: RefitConfig,
    policy_reports: Sequence[Mapping[str, Any]],
    engine_reports: Sequence[Sequence[Mapping[str, Any]]],
) -> NemoRlPlan:
    """Plan from NeMo RL's config (``policy.model_name``, ``megatron_cfg``, ``vllm_cfg``)
    and the workers' reports; the spec is the HF config the policy loaded."""
    policy = master_config["policy"]
    generation = policy["generation"]
    spec = fp8_spec(engine_spec(policy["model_name"]), generation.get("vllm_cfg") or {})
    reports = sorted(policy_reports, key=lambda r: int(r["rank"]))
    train = train_parallel(policy, len(reports))
    infer_world = sum(len(e) for e in engine_reports)
    infer = infer_parallel(generation, infer_world)
    megatron = megatron_options(train, refit, reports)
    dtype = precision(generation.get("vllm_cfg") or {}, "precision", "policy.generation.vllm_cfg")
    vllm = vllm_options(dtype, engine_reports)
    sources, destinations = refit_layouts(spec, train, infer, megatron, vllm)
    check_megatron_sources(sources, train, megatron, reports)
    check_vllm_destinations(destinations, infer, vllm, engine_reports)
    placement = colocation(infer, reports, engine_reports) if colocated(generation) else None
    plan = plan_refit(spec, sources, destinations, bucket_mb=refit.bucket_mb, colocation=placement)
    world = train.world_size + infer.world_size
    slices = tuple(rank_plan(plan, r).to_json() for r in range(world))
    return NemoRlPlan(plan, train, infer, slices)


def plan_nemo_rl_sglang(
    master_config: Mapping[str, Any],
    refit: RefitConfig,
    policy_reports: Sequence[Mapping[str, Any]],
    engines: int,
) -> NemoRlPlan:
    """Plan for NeMo RL's SGLang generation (``backend: sglang``, colocated): from the
    config and the policy workers' reports alone, since an SGLang server answers a
    weight update with success or failure only. SGLang rank ``d`` (server ``d // tp``,
    tp rank ``d % tp``) is placed where NeMo RL places it, on the placement group's GPU
    ``d``, the policy rank ``d``'s; each SGLang rank confirms that GPU and checks its
    slice against its live parameters before it connects
    (``integrations/sglang/receiver.py::refit_connect_colocated``)."""
    policy = master_config["policy"]
    generation = policy["generation"]
    spec = engine_spec(policy["model_name"])
    reports = sorted(policy_reports, key=lambda r: int(r["rank"]))
    train = train_parallel(policy, len(reports))
    infer = sglang_infer_parallel(generation, engines)
    if infer.world_size > train.world_size:
        raise PlanError(
            f"colocated SGLang: {engines} servers of tp {infer.tp} need {infer.world_size} "
            f"GPUs, the policy runs on {train.world_size}; give SGLang at most the policy's "
            "GPUs (sglang_server_config.num_gpus)"
        )
    unnamed = [f"policy rank {r['rank']}" for r in reports if not r.get("gpu")]
    if unnamed:
        raise PlanError(
            f"colocated refit: {', '.join(unnamed)} report no GPU (a CPU process names the "
            "GPU it stands for in $NRR_DEVICE)"
        )
    megatron = megatron_options(train, refit, reports)
    dtype = precision(generation["sglang_cfg"], "dtype", "policy.generation.sglang_cfg")
    sources, destinations = refit_layouts(
        spec, train, infer, megatron, VllmOptions(params_dtype=dtype), engine="sglang"
    )
    check_megatron_sources(sources, train, megatron, reports)
    placement = Colocation.same_index(train.world_size, infer.world_size)
    plan = plan_refit(spec, sources, destinations, bucket_mb=refit.bucket_mb, colocation=placement)
    world = train.world_size + infer.world_size
    slices = tuple(rank_plan(plan, r).to_json() for r in range(world))
    return NemoRlPlan(plan, train, infer, slices, engine="SGLang")
