"""The ``plan``, ``demo``, ``bench`` and ``simulate`` commands."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from .integrations.spawn import RunConfig, RunResult, build_layouts, run_local
from .plan import RefitPlan, plan_broadcast, plan_refit
from .spec import load_model_spec


def add_run_arguments(p: argparse.ArgumentParser, steps: int) -> None:
    p.add_argument("--model", default="small-qwen3", help="preset name or config.json path")
    p.add_argument("--train", default="tp=2,pp=2", help="tp=,pp=,vpp=,cp=,dp=,ep=,etp=")
    p.add_argument("--infer", default="tp=2,dp=2", help="tp=,pp=,dp=,engine_dp=,ep=")
    p.add_argument("--bucket-mb", type=float, default=512)
    p.add_argument(
        "--relay",
        choices=("none", "chain", "domain", "auto"),
        default=None,
        help="chain: forward slices between inference replicas; domain (simulate only): "
        "one copy per NVLink domain, forwarded inside it; auto (simulate only, its "
        "default): the mode the cluster model predicts fastest (default elsewhere: none)",
    )
    p.add_argument("--train-dtype", default=None, help="training params dtype (e.g. float32)")
    p.add_argument(
        "--first-stage-layers",
        type=int,
        default=None,
        help="Megatron num_layers_in_first_pipeline_stage",
    )
    p.add_argument(
        "--last-stage-layers",
        type=int,
        default=None,
        help="Megatron num_layers_in_last_pipeline_stage",
    )
    p.add_argument("--infer-dtype", default=None, help="inference params dtype")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--backends", default="reshard,broadcast")
    p.add_argument("--timeout", type=float, default=600, help="seconds any wait may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--transport",
        choices=("gloo", "cupy-nccl"),
        default="gloo",
        help="gloo on CPU (default) or CuPy NCCL, one GPU per rank",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="with --transport gloo: where the ranks' tensors live (cuda: through host twins)",
    )
    p.add_argument(
        "--host-staged",
        action="store_true",
        help="with --transport gloo: exchange through host twins even for CPU tensors",
    )
    p.add_argument(
        "--overlap",
        choices=("auto", "on", "off"),
        default="auto",
        help="overlap pack/unpack with the wire (two staging sets); auto: on for CUDA",
    )
    p.add_argument("--json", action="store_true")


def _config(args: argparse.Namespace) -> RunConfig:
    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    for b in backends:
        if b not in ("reshard", "broadcast"):
            raise ValueError(f"unknown backend {b!r}; choose from reshard, broadcast")
    if args.steps < 1:
        raise ValueError("--steps must be >= 1")
    if args.relay is None:
        args.relay = "auto" if args.command == "simulate" else "none"
    if args.relay in ("auto", "domain") and args.command != "simulate":
        raise ValueError(
            f"--relay {args.relay} needs a cluster model (which ranks share NVLink): "
            "use it with simulate"
        )
    return RunConfig(
        model=args.model,
        train=args.train,
        infer=args.infer,
        backends=backends,
        steps=args.steps,
        bucket_mb=args.bucket_mb,
        timeout_s=args.timeout,
        seed=args.seed,
        train_dtype=args.train_dtype,
        infer_dtype=args.infer_dtype,
        transport=args.transport,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
        relay=args.relay,
        overlap={"auto": None, "on": True, "off": False}[args.overlap],
        device=args.device,
        host_staged=True if args.host_staged else None,
    )


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def plan_summary(plan: RefitPlan, seconds: float) -> dict[str, Any]:
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
    }


def _ratio(summary: dict[str, Any]) -> str:
    return f"{summary['baseline_bytes'] / max(1, summary['total_bytes']):.2f}x"


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


def cmd_plan(args: argparse.Namespace) -> int:
    cfg = _config(args)
    t0 = time.perf_counter()
    spec, sources, destinations = build_layouts(cfg)
    plan = plan_refit(spec, sources, destinations, bucket_mb=cfg.bucket_mb, relay=cfg.relay)
    summary = plan_summary(plan, time.perf_counter() - t0)
    if args.out:
        write_plan_file(args.out, plan.to_json())
    if args.json:
        print(json.dumps(summary))
        return 0
    print(
        f"plan {plan.fingerprint}: {spec.name}, training {cfg.train} ({plan.num_sources} ranks)"
        f" -> inference {cfg.infer} ({plan.num_destinations} ranks)"
    )
    rows = [
        ("bytes moved", _mb(summary["total_bytes"])),
        ("minimum (destination needs)", _mb(summary["min_bytes"])),
        ("gather-broadcast baseline", _mb(summary["baseline_bytes"])),
        (
            "baseline / reshard",
            f"{summary['baseline_bytes'] / max(1, summary['total_bytes']):.2f}x",
        ),
        ("max bytes sent by one rank", _mb(summary["max_send_bytes"])),
        ("max bytes received by one rank", _mb(summary["max_recv_bytes"])),
        (
            "transfers / messages / rounds",
            f"{summary['transfers']} / {summary['messages']} / {summary['rounds']}",
        ),
        ("plan build", f"{summary['build_seconds']:.2f} s"),
    ]
    for k, v in rows:
        print(f"  {k:32} {v}")
    if args.out:
        print(f"  plan written to {args.out}")
    return 0


def _step_stats(result: RunResult, backend: str) -> dict[str, float]:
    """Per step, the slowest rank's time; then the median over steps."""
    per_rank = [r["backends"][backend]["timings"] for r in result.ranks]
    steps = len(per_rank[0])
    wall = [max(t[k][0] for t in per_rank) for k in range(steps)]
    host = [max(t[k][0] - t[k][1] for t in per_rank) for k in range(steps)]
    return {
        "median_s": statistics.median(wall),
        "min_s": min(wall),
        "median_host_s": statistics.median(host),
        "steps": steps,
    }


def run_report(cfg: RunConfig, show_progress: bool) -> tuple[dict[str, Any], RunResult]:
    t0 = time.perf_counter()
    spec, sources, destinations = build_layouts(cfg)
    plan = plan_refit(spec, sources, destinations, bucket_mb=cfg.bucket_mb, relay=cfg.relay)
    build = time.perf_counter() - t0
    bytes_by_backend = {"reshard": plan.stats.total_bytes}
    if "broadcast" in cfg.backends:
        bytes_by_backend["broadcast"] = plan_broadcast(
            spec, sources, destinations, cfg.bucket_mb
        ).total_bytes

    def progress(done: int, total: int) -> None:
        if show_progress:
            width = 30
            filled = width * done // max(1, total)
            sys.stderr.write(
                f"\r  [{'#' * filled}{' ' * (width - filled)}] {done}/{total} rank-steps"
            )
            sys.stderr.flush()

    result = run_local(cfg, plan, join_timeout_s=cfg.timeout_s + 300, progress=progress)
    if show_progress:
        sys.stderr.write("\n")
    report: dict[str, Any] = {
        "config": {
            k: getattr(cfg, k)
            for k in ("model", "train", "infer", "steps", "bucket_mb", "transport", "relay")
        },
        "plan": plan_summary(plan, build),
        "errors": {str(k): v for k, v in result.errors().items()},
        "backends": {},
    }
    if report["errors"]:
        return report, result
    for backend in cfg.backends:
        stats = _step_stats(result, backend)
        dst = [r for r in result.ranks if r["rank"] >= plan.num_sources]
        bad = {
            r["rank"] - plan.num_sources: r["backends"][backend].get("mismatches")
            for r in dst
            if r["backends"][backend].get("mismatches")
        }
        report["backends"][backend] = {
            **stats,
            "bytes": bytes_by_backend[backend],
            "verified": cfg.verify and not bad,
            "mismatches": bad,
        }
    return report, result


def print_report(report: dict[str, Any]) -> None:
    cfg, plan = report["config"], report["plan"]
    print(
        f"refit {cfg['model']}: training {cfg['train']} ({plan['sources']} ranks) -> "
        f"inference {cfg['infer']} ({plan['destinations']} ranks), gloo on localhost, "
        f"{cfg['steps']} timed steps"
    )
    base = report["backends"].get("broadcast", {}).get("median_s")
    print(
        f"  {'backend':10} {'bytes moved':>14} {'median refit':>13} {'speedup':>8} "
        f"{'host overhead':>14}  check"
    )
    for name, b in report["backends"].items():
        speed = f"{base / b['median_s']:.2f}x" if base else "-"
        check = "bit-exact" if b["verified"] else f"MISMATCH {b['mismatches']}"
        print(
            f"  {name:10} {_mb(b['bytes']):>14} {b['median_s'] * 1e3:>10.1f} ms {speed:>8} "
            f"{b['median_host_s'] * 1e3:>11.1f} ms  {check}"
        )
    print(
        f"  minimum bytes {_mb(plan['min_bytes'])}; plan {plan['fingerprint']}, "
        f"{plan['messages']} messages in {plan['rounds']} round(s), "
        f"built in {plan['build_seconds']:.2f} s"
    )


def _finish(report: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(report))
    if report["errors"]:
        for rank, err in sorted(report["errors"].items(), key=lambda kv: int(kv[0])):
            print(f"nemo-refit-reshard: rank {rank} failed: {err}", file=sys.stderr)
        return 1
    if not as_json:
        print_report(report)
    return 0 if all(b["verified"] for b in report["backends"].values()) else 1


def cmd_demo(args: argparse.Namespace) -> int:
    report, _ = run_report(_config(args), show_progress=sys.stderr.isatty() and not args.json)
    return _finish(report, args.json)


def cmd_bench(args: argparse.Namespace) -> int:
    report, _ = run_report(_config(args), show_progress=sys.stderr.isatty() and not args.json)
    return _finish(report, args.json)


def _plot_simulation(plan: RefitPlan, prediction: Any, links: Any, path: str) -> None:
    """Per-rank bytes sent / received (NVLink and NIC) and the node-to-node traffic matrix."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plan import traffic_matrix

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    ranks = list(range(len(prediction.gpu_bytes)))
    sent = [(g.sent_nvlink, g.sent_nic) for g in prediction.gpu_bytes]
    recv = [(g.received_nvlink, g.received_nic) for g in prediction.gpu_bytes]
    width = 0.4
    for shift, rows, label in ((-width / 2, sent, "sent"), (width / 2, recv, "received")):
        xs = [r + shift for r in ranks]
        left.bar(xs, [a / 1e9 for a, _ in rows], width, label=f"{label} NVLink")
        left.bar(
            xs, [b / 1e9 for _, b in rows], width, [a / 1e9 for a, _ in rows], label=f"{label} NIC"
        )
    left.axvline(plan.num_sources - 0.5, color="grey", linestyle=":")
    left.set(xlabel="refit-group rank (training | inference)", ylabel="GB", title="per GPU")
    left.legend()
    nodes = sorted(set(links.placement.nodes))
    matrix = traffic_matrix(plan, links)
    grid = [[matrix.get((a, b), 0) / 1e9 for b in nodes] for a in nodes]
    image = right.imshow(grid, cmap="viridis")
    right.set(xlabel="destination node", ylabel="source node", title="traffic (GB)")
    right.set_xticks(range(len(nodes)), [str(n) for n in nodes])
    right.set_yticks(range(len(nodes)), [str(n) for n in nodes])
    fig.colorbar(image, ax=right)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _uneven_stages(cfg: RunConfig) -> tuple[RunConfig, str | None]:
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


def cmd_simulate(args: argparse.Namespace) -> int:
    """Predict the refit's time on a cluster model: no processes, no GPUs."""
    from .plan import (
        Cluster,
        Placement,
        Topology,
        bandwidth_floor,
        predict_broadcast,
        predict_refit,
        predict_timeline,
    )

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError(
                "--plot needs matplotlib, which is not installed: pip install -e '.[plot]' "
                "(or pip install matplotlib)"
            ) from None
    cfg = _config(args)
    cluster = Cluster.parse(args.cluster)
    cfg, stages_note = _uneven_stages(cfg)
    spec, sources, destinations = build_layouts(cfg)
    if args.placement == "separate":
        placement = Placement.packed(len(sources), len(destinations), cluster)
    else:
        try:
            nodes = tuple(int(x) for x in args.placement.split(","))
        except ValueError:
            raise ValueError(
                f"--placement {args.placement!r}: use 'separate' or a comma list of node ids"
            ) from None
        placement = Placement.explicit(nodes, len(sources), len(destinations), cluster)
    # Replica choice balances predicted link time on this cluster, not bytes per sender;
    # ``relay="auto"`` schedules only the modes that could still win (``plan/relay_choice.py``).
    links = Topology(cluster, placement)
    plan = plan_refit(
        spec, sources, destinations, bucket_mb=cfg.bucket_mb, relay=cfg.relay, links=links
    )
    choice = plan.relay_choice
    pred = predict_refit(plan, links)
    floor = bandwidth_floor(plan, sources, destinations, links)
    bplan = plan_broadcast(spec, sources, destinations, cfg.bucket_mb)
    base = predict_broadcast(bplan, links)
    report = {
        "model": spec.name,
        "train": cfg.train,
        "infer": cfg.infer,
        "relay": cfg.relay if choice is None else f"auto: {choice.chosen}",
        "relay_choice": None if choice is None else choice.reason,
        "pipeline_stages_note": stages_note,
        "cluster": str(cluster),
        "training_nodes": len(placement.training_nodes),
        "inference_nodes": len(placement.inference_nodes),
        "plan": plan.fingerprint,
        "predicted": pred.to_json(),
        "predicted_s": pred.seconds,
        "predicted_timeline_s": predict_timeline(plan, links),
        "floor": floor.to_json(),
        "floor_s": floor.seconds,
        "floor_term": floor.binding.key,
        "ratio_to_floor": pred.seconds / floor.seconds if floor.seconds else None,
        "baseline_s": base.seconds,
        "baseline_gather_s": base.gather_seconds,
        "baseline_broadcast_s": base.broadcast_seconds,
        "speedup": base.seconds / pred.seconds if pred.seconds else None,
    }
    if args.plot:
        _plot_simulation(plan, pred, links, args.plot)
    if args.json:
        print(json.dumps(report))
        return 0

    def ms(x: float) -> str:
        return f"{x * 1e3:.3f} ms"

    def times(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    b = floor.binding
    if stages_note:
        print(f"note: {stages_note}")
    print(
        f"simulate {spec.name}: training {cfg.train} ({plan.num_sources} GPUs on "
        f"{report['training_nodes']} nodes) -> inference {cfg.infer} ({plan.num_destinations} "
        f"GPUs on {report['inference_nodes']} nodes), relay {report['relay']}"
    )
    slowest = (
        f"slowest round {pred.slowest_round}: rank {pred.bottleneck_rank} {pred.bottleneck_link}"
        if pred.slowest_round is not None
        else "no messages"
    )
    rows = [("cluster", str(cluster))]
    if choice is not None:
        rows.append(("relay choice", choice.reason))
    rows += [
        ("predicted refit", f"{ms(pred.seconds)} ({len(pred.round_seconds)} rounds; {slowest})"),
        ("bandwidth floor", f"{ms(floor.seconds)} (({b.key}) {b.what}, {b.where})"),
        ("predicted / floor", times(report["ratio_to_floor"])),
        ("no round barrier (timeline)", ms(report["predicted_timeline_s"])),
        ("gather-broadcast baseline", ms(base.seconds)),
        ("speedup over baseline", times(report["speedup"])),
    ]
    for k, v in rows:
        print(f"  {k:27} {v}")
    if args.plot:
        print(f"  plot written to {args.plot}")
    return 0


def _cmd_gpu_check(args: argparse.Namespace) -> int:
    from .gpu_check import cmd_gpu_check

    return cmd_gpu_check(args)


def add_commands(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="build the transfer plan and print its stats")
    add_run_arguments(plan, steps=1)
    plan.add_argument("--out", help="write the plan JSON here")
    plan.set_defaults(func=cmd_plan)
    demo = sub.add_parser("demo", help="refit between local processes, reshard vs broadcast")
    add_run_arguments(demo, steps=3)
    demo.set_defaults(func=cmd_demo)
    bench = sub.add_parser("bench", help="like demo with more steps; --json for the figures")
    add_run_arguments(bench, steps=10)
    bench.set_defaults(func=cmd_bench)
    simulate = sub.add_parser("simulate", help="predict refit time on a cluster model")
    add_run_arguments(simulate, steps=1)
    simulate.add_argument(
        "--cluster",
        default="gpus_per_node=8,nvlink_gbps=450,nic_gbps=50",
        help="gpus_per_node=,nvlink_gbps=,nic_gbps=,nvlink_latency_us=,nic_latency_us= "
        "(GB/s per GPU per direction: nic_gbps=50 is one 400 Gb/s NIC per GPU)",
    )
    simulate.add_argument(
        "--placement",
        default="separate",
        help="separate (training and inference pools on their own nodes, packed in rank "
        "order) or a comma list of node ids, one per refit rank (training ranks first)",
    )
    simulate.add_argument("--plot", help="write a PNG of per-GPU bytes and node traffic here")
    simulate.set_defaults(func=cmd_simulate)
    gpu = sub.add_parser(
        "gpu-check", help="the GPU paths on one GPU: NCCL, pack/unpack, overlap (needs CUDA)"
    )
    gpu.add_argument("--repeats", type=int, default=5)
    gpu.add_argument("--quick", action="store_true", help="a small model instead of DeepSeek")
    gpu.set_defaults(func=_cmd_gpu_check)
