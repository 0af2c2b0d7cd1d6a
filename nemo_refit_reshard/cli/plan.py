"""The ``plan`` and ``simulate`` commands: build a refit's plan and print its figures;
predict its time on a cluster model. Neither starts a process or needs a GPU."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..layouts import RankLayout
from ..layouts.base import paused_gc
from ..plan import (
    BroadcastPrediction,
    Cluster,
    Colocation,
    Floor,
    Placement,
    Prediction,
    RefitPlan,
    Topology,
    bandwidth_floor,
    plan_refit,
    predict_broadcast_layouts,
    predict_refit,
    predict_timeline,
)
from ..plan.analysis.delta_memory import delta_memory_report
from ..plan.result.memory import memory_report
from ..runner import RunConfig, build_layouts
from ..spec import ModelSpec, load_model_spec
from .delta_predict import baseline_memory, delta_memory_row, print_delta, simulate_delta
from .plot import plot_simulation, require_matplotlib
from .progress import Progress
from .run_args import run_config


def cmd_plan(args: argparse.Namespace) -> int:
    """Build the plan, optionally write it to ``--out``, print its figures."""
    cfg = run_config(args)
    timed = timed_plan(cfg)
    summary = plan_summary(timed.plan, timed.seconds)
    # Not in plan_summary (a run's report): computing it walks every rank's messages.
    summary["memory"] = memory_report(timed.plan, overlap=bool(cfg.overlap))
    if cfg.colocated:  # the colocated plan of the same run, beside the separate one
        colocation = Colocation.same_index(len(timed.sources), len(timed.destinations))
        colocated = plan_refit(
            timed.spec, timed.sources, timed.destinations, cfg.bucket_mb, colocation=colocation
        )
        summary["colocated"] = {
            "fingerprint": colocated.fingerprint,
            "memory": memory_report(colocated),
        }
    if getattr(args, "delta", False):
        summary["delta_baseline_bytes"] = baseline_memory(timed.plan)
        baseline = getattr(args, "delta_baseline", "device")
        summary["memory"] = delta_memory_report(timed.plan, summary["memory"], baseline)
        if cfg.colocated:  # the hosts' baselines, scratch and held copies of guests' messages
            memory = summary["colocated"]["memory"]
            summary["colocated"]["memory"] = delta_memory_report(colocated, memory, baseline)
    if args.out:
        write_plan_file(args.out, timed.plan.to_json())
    if args.json:
        print(json.dumps(summary))
    else:
        print_plan(plan_title(cfg, timed), plan_rows(summary) + memory_rows(summary), args.out)
    return 0


def memory_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """``plan``'s rows on memory beyond the live weights (``plan/result/memory.py``)."""
    rows = [("max extra bytes of one rank", mem_row(summary["memory"]))]
    if "colocated" in summary:
        rows.append(("colocated: max extra bytes", mem_row(summary["colocated"]["memory"])))
    if "delta_baseline_bytes" in summary:
        rows.append(("delta refit: baselines", delta_memory_row(summary)))
    return rows


def mem_row(memory: dict[str, Any]) -> str:
    text = f"{mib(memory['max_peak_extra_bytes'])} (staging bound {mib(memory['staging_bound'])}"
    if memory["max_fp8_scratch"]:
        text += f"; FP8 shadow scratch up to {mib(memory['max_fp8_scratch'])}"
    if "delta_baseline" in memory:
        text += f"; with the delta refit's baselines ({memory['delta_baseline']}) and scratch"
        if memory["max_delta_host_bytes"]:
            text += f"; host memory up to {mib(memory['max_delta_host_bytes'])}"
    return text + ")"


@paused_gc  # millions of acyclic boxes and transfers stay alive: nothing to collect
def cmd_simulate(args: argparse.Namespace) -> int:
    """Predict the refit's time on a cluster model: no processes, no GPUs."""
    if args.plot:
        require_matplotlib()
    cfg = run_config(args)
    cluster = Cluster.parse(args.cluster)
    cfg, stages_note = uneven_stages(cfg)
    progress = Progress("simulate")
    refit = plan_on_cluster(cfg, cluster, args.placement, progress)
    prediction = predict(refit, progress)
    # None: not asked for
    delta = simulate_delta(args, refit.plan, refit.topology, prediction.refit, progress)
    # The text shows no fingerprint: serialising a 256-GPU plan to hash it takes seconds.
    with progress.step("the plan's fingerprint"):
        report = simulation_report(cfg, refit, prediction, stages_note, fingerprint=args.json)
    if args.plot:
        plot_simulation(refit.plan, prediction.refit, refit.topology, args.plot)
    if args.json:
        print(json.dumps(report if delta is None else {**report, "delta": delta.to_json()}))
    else:
        title, rows = simulation_title(report, refit), simulation_rows(report, refit, prediction)
        print_simulation(stages_note, title, rows, args.plot)
        if delta is not None:
            print_delta(delta)
    return 0


@dataclass(frozen=True)
class TimedPlan:
    """A run's layouts, the reshard plan for them and the seconds both took to build."""

    spec: ModelSpec
    sources: list[RankLayout]
    destinations: list[RankLayout]
    plan: RefitPlan
    seconds: float


def timed_plan(cfg: RunConfig) -> TimedPlan:
    """Build the run's layouts and plan, timing both (the figure ``plan`` reports)."""
    t0 = time.perf_counter()
    spec, sources, destinations = build_layouts(cfg)
    plan = plan_refit(spec, sources, destinations, bucket_mb=cfg.bucket_mb, relay=cfg.relay)
    return TimedPlan(spec, sources, destinations, plan, time.perf_counter() - t0)


def plan_summary(plan: RefitPlan, seconds: float) -> dict[str, Any]:
    """The plan's figures as JSON (``plan --json``; the ``plan`` of a run's report)."""
    s = plan.stats
    return {
        "model": plan.model,
        "fingerprint": plan.fingerprint,
        "sources": plan.num_sources,
        "destinations": plan.num_destinations,
        "total_bytes": s.total_bytes,
        "min_bytes": s.min_bytes,
        "baseline_bytes": s.baseline_bytes,
        "max_send_bytes": max(s.bytes_sent, default=0),
        "max_recv_bytes": max(s.bytes_received, default=0),
        "transfers": s.num_transfers,
        "messages": s.num_messages,
        "rounds": s.num_rounds,
        "build_seconds": round(seconds, 3),
        "bytes_sent": list(s.bytes_sent),
        "bytes_received": list(s.bytes_received),
        **({"bytes_by_dtype": dict(s.bytes_by_dtype)} if s.bytes_by_dtype else {}),
    }


def plan_title(cfg: RunConfig, timed: TimedPlan) -> str:
    """``plan``'s first line: the plan, the model and both sides of the refit."""
    plan = timed.plan
    title = (
        f"plan {plan.fingerprint}: {timed.spec.name}, training {cfg.train} ({plan.num_sources}"
        f" ranks) -> {engine_word(cfg.infer_engine)}inference {cfg.infer} "
        f"({plan.num_destinations} ranks)"
    )
    quant = timed.spec.arch.quant
    if quant is not None:  # layouts/fp8_wire.py
        by_dtype = ", ".join(f"{mib(n)} {d}" for d, n in plan.stats.bytes_by_dtype)
        title += (
            f"\n  {quant} engine: e4m3 + scales on the wire where training ranks hold whole "
            f"blocks, the rest quantized by the inference ranks; on the wire: {by_dtype}"
        )
    return title


def engine_word(engine: str) -> str:
    """The titles name the inference engine when it is not the default (vLLM)."""
    return "" if engine == "vllm" else {"sglang": "SGLang "}.get(engine, f"{engine} ")


def plan_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """``plan``'s table: (figure, value) rows from the plan's summary."""
    return [
        ("bytes moved", mib(summary["total_bytes"])),
        ("minimum (destination needs)", mib(summary["min_bytes"])),
        ("gather-broadcast baseline", mib(summary["baseline_bytes"])),
        (
            "baseline / reshard",
            f"{summary['baseline_bytes'] / max(1, summary['total_bytes']):.2f}x",
        ),
        ("max bytes sent by one rank", mib(summary["max_send_bytes"])),
        ("max bytes received by one rank", mib(summary["max_recv_bytes"])),
        (
            "transfers / messages / rounds",
            f"{summary['transfers']} / {summary['messages']} / {summary['rounds']}",
        ),
        ("plan build", f"{summary['build_seconds']:.2f} s"),
    ]


def print_plan(title: str, rows: Sequence[tuple[str, str]], out: str | None) -> None:
    """``plan``'s text: the title, the table, where the plan was written."""
    print(title)
    print_rows(rows, width=32)
    if out:
        print(f"  plan written to {out}")


def print_rows(rows: Sequence[tuple[str, str]], width: int) -> None:
    """A two-column table, indented, the figure names padded to ``width``."""
    for k, v in rows:
        print(f"  {k:{width}} {v}")


def mib(n: float) -> str:
    """Bytes in MiB, as the tables print them."""
    return f"{n / 2**20:,.1f} MiB"


def write_plan_file(path: str, text: str) -> None:
    """Write a plan file whole or not at all: a regular file goes through a temporary
    file beside it and an atomic rename, so a full disk or a crash never leaves half a
    plan under the real name. A failure is a ``ValueError`` naming the path (one line)."""
    target = Path(path)
    direct = target.exists() and not target.is_file()  # a device or pipe: no rename
    tmp = target if direct else target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            if not direct:
                os.fsync(f.fileno())
        if not direct:
            os.replace(tmp, target)
    except OSError as err:
        if not direct:
            tmp.unlink(missing_ok=True)
        raise ValueError(f"could not write the plan to {path}: {err}") from None


# --- simulate: planning, prediction, reporting -------------------------------------


def uneven_stages(cfg: RunConfig) -> tuple[RunConfig, str | None]:
    """For ``simulate`` (a what-if tool): when the layers do not split evenly over the
    pipeline stages and no first/last stage sizes are given, Megatron would refuse;
    choose them (middle stages ``ceil(L/pp)`` layers, the rest split over the first
    and last) and say so, instead of failing a prediction over a detail."""
    spec = load_model_spec(cfg.model)
    tpar, _ = cfg.parallel()
    layers, pp = spec.arch.num_layers, tpar.pp
    given = cfg.first_stage_layers is not None or cfg.last_stage_layers is not None
    if pp < 3 or layers % pp == 0 or given or tpar.vpp > 1:
        return cfg, None
    middle = -(-layers // pp)
    rest = layers - (pp - 2) * middle
    if rest < 2:
        return cfg, None  # Megatron's own error explains it
    first, last = -(-rest // 2), rest // 2
    note = (
        f"{layers} layers do not split over pp={pp}: simulating Megatron's "
        f"num_layers_in_first_pipeline_stage={first}, "
        f"num_layers_in_last_pipeline_stage={last} "
        "(choose with --first-stage-layers / --last-stage-layers)"
    )
    return replace(cfg, first_stage_layers=first, last_stage_layers=last), note


@dataclass(frozen=True)
class ClusterRefit:
    """A refit planned for a cluster model: both sides' layouts, the node each rank sits
    on and the plan built for those links."""

    spec: ModelSpec
    sources: list[RankLayout]
    destinations: list[RankLayout]
    topology: Topology  # the cluster and the node of every rank
    plan: RefitPlan

    @property
    def cluster(self) -> Cluster:
        return self.topology.cluster

    @property
    def placement(self) -> Placement:
        return self.topology.placement


@dataclass(frozen=True)
class SimulatedFigures:
    """The cluster model's figures for one planned refit."""

    refit: Prediction  # per-round times, bottleneck, bytes per GPU and link
    floor: Floor  # the fastest any schedule could be, and why
    baseline: BroadcastPrediction  # the gather-broadcast baseline
    timeline_s: float  # predict_timeline: the refit without round barriers


def placement_for(text: str, sources: int, destinations: int, cluster: Cluster) -> Placement:
    """``--placement``: ``separate`` pools packed in rank order, or one node id per rank."""
    if text == "separate":
        return Placement.packed(sources, destinations, cluster)
    try:
        nodes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(
            f"--placement {text!r}: use 'separate' or a comma list of node ids"
        ) from None
    return Placement.explicit(nodes, sources, destinations, cluster)


def plan_on_cluster(
    cfg: RunConfig, cluster: Cluster, placement_text: str, progress: Progress | None = None
) -> ClusterRefit:
    """Build the layouts, place the ranks and plan the refit for the cluster's links."""
    progress = progress or Progress("simulate", quiet_s=float("inf"))
    with progress.step("building the layouts"):
        spec, sources, destinations = build_layouts(cfg)
    placement = placement_for(placement_text, len(sources), len(destinations), cluster)
    # Replica choice balances predicted link time on this cluster, not bytes per sender;
    # ``relay="auto"`` schedules only the modes that could still win (the plan package).
    links = Topology(cluster, placement)
    with progress.step(f"planning (relay {cfg.relay})"):
        plan = plan_refit(
            spec, sources, destinations, bucket_mb=cfg.bucket_mb, relay=cfg.relay, links=links
        )
    return ClusterRefit(spec, sources, destinations, links, plan)


def predict(refit: ClusterRefit, progress: Progress | None = None) -> SimulatedFigures:
    """The plan's predicted time, its bandwidth floor and the gather-broadcast baseline's
    time on the refit's cluster. The baseline is priced from the layouts
    (``predict_broadcast_layouts``: the same figures as pricing its plan, which at 256
    GPUs would hold 11 million transfers); its buckets do not change its time."""
    progress = progress or Progress("simulate", quiet_s=float("inf"))
    plan, links = refit.plan, refit.topology
    with progress.step("the predictions and the floor"):
        return SimulatedFigures(
            refit=predict_refit(plan, links),
            floor=bandwidth_floor(plan, refit.sources, refit.destinations, links),
            baseline=predict_broadcast_layouts(
                refit.spec, refit.sources, refit.destinations, links
            ),
            timeline_s=predict_timeline(plan, links),
        )


def simulation_report(
    cfg: RunConfig,
    refit: ClusterRefit,
    pred: SimulatedFigures,
    stages_note: str | None,
    fingerprint: bool = True,
) -> dict[str, Any]:
    """Every figure ``simulate`` reports, as JSON (``simulate --json``); ``plan`` (the
    fingerprint) only with ``fingerprint``."""
    choice = refit.plan.relay_choice
    p, floor, base = pred.refit, pred.floor, pred.baseline
    report = {
        "model": refit.spec.name,
        "train": cfg.train,
        "infer": cfg.infer,
        "infer_engine": cfg.infer_engine,
        "relay": cfg.relay if choice is None else f"auto: {choice.chosen}",
        "relay_choice": None if choice is None else choice.reason,
        "pipeline_stages_note": stages_note,
        "cluster": str(refit.cluster),
        "training_nodes": len(refit.placement.training_nodes),
        "inference_nodes": len(refit.placement.inference_nodes),
        "plan": refit.plan.fingerprint if fingerprint else None,
        "predicted": p.to_json(),
        "predicted_s": p.seconds,
        "predicted_timeline_s": pred.timeline_s,
        "floor": floor.to_json(),
        "floor_s": floor.seconds,
        "floor_term": floor.binding.key,
        "ratio_to_floor": p.seconds / floor.seconds if floor.seconds else None,
        "baseline_s": base.seconds,
        "baseline_gather_s": base.gather_seconds,
        "baseline_broadcast_s": base.broadcast_seconds,
        "speedup": base.seconds / p.seconds if p.seconds else None,
    }
    if not fingerprint:
        del report["plan"]
    return report


def simulation_title(report: dict[str, Any], refit: ClusterRefit) -> str:
    """``simulate``'s first line: both sides of the refit, their nodes, the relay mode."""
    plan = refit.plan
    return (
        f"simulate {report['model']}: training {report['train']} ({plan.num_sources} GPUs on "
        f"{report['training_nodes']} nodes) -> {engine_word(report['infer_engine'])}"
        f"inference {report['infer']} "
        f"({plan.num_destinations} GPUs on {report['inference_nodes']} nodes), "
        f"relay {report['relay']}"
    )


def simulation_rows(
    report: dict[str, Any], refit: ClusterRefit, pred: SimulatedFigures
) -> list[tuple[str, str]]:
    """``simulate``'s table: (figure, value) rows."""
    p, b = pred.refit, pred.floor.binding
    slowest = (
        f"slowest round {p.slowest_round}: rank {p.bottleneck_rank} {p.bottleneck_link}"
        if p.slowest_round is not None
        else "no messages"
    )
    rows = [("cluster", report["cluster"])]
    choice = refit.plan.relay_choice
    if choice is not None:  # relay "auto": which mode won, and by how much
        rows.append(("relay choice", choice.reason))
    rows += [
        ("predicted refit", f"{ms(p.seconds)} ({len(p.round_seconds)} rounds; {slowest})"),
        ("bandwidth floor", f"{ms(pred.floor.seconds)} (({b.key}) {b.what}, {b.where})"),
        ("predicted / floor", times(report["ratio_to_floor"])),
        ("no round barrier (timeline)", ms(pred.timeline_s)),
        ("gather-broadcast baseline", ms(pred.baseline.seconds)),
        ("speedup over baseline", times(report["speedup"])),
    ]
    return rows


def print_simulation(
    note: str | None, title: str, rows: Sequence[tuple[str, str]], plot: str | None
) -> None:
    """``simulate``'s text: any note on the pipeline stages, the title, the table, where
    the plot was written."""
    if note:
        print(f"note: {note}")
    print(title)
    print_rows(rows, width=27)
    if plot:
        print(f"  plot written to {plot}")


def ms(seconds: float) -> str:
    """Seconds as milliseconds, to the microsecond."""
    return f"{seconds * 1e3:.3f} ms"


def times(ratio: float | None) -> str:
    """A ratio as ``1.23x``; ``-`` when there is none (a zero denominator)."""
    return "-" if ratio is None else f"{ratio:.2f}x"
