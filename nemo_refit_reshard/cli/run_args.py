"""The arguments ``plan``, ``demo``, ``bench`` and ``simulate`` share, and the
``RunConfig`` they describe."""

from __future__ import annotations

import argparse

from ..layouts.refit import INFER_ENGINES
from ..runner import RunConfig

BACKENDS = ("reshard", "broadcast", "delta")  # delta: reshard sending deltas (--delta)
# Relay modes that need to know which ranks share NVLink: only ``simulate`` has a cluster.
CLUSTER_RELAYS = ("auto", "domain")


def add_run_arguments(p: argparse.ArgumentParser, steps: int) -> None:
    """The model, both parallelisms and how to run the refit; ``steps`` is the default
    number of timed steps."""
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
    p.add_argument(
        "--infer-engine",
        choices=INFER_ENGINES,
        default="vllm",
        help="whose parameter layouts the inference ranks hold: vLLM's (default) or "
        "SGLang's (what layouts/sglang.py proves: tp=, dp=, ep=)",
    )
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
        help=(
            "with --transport gloo: where the ranks' tensors live (cuda: through pinned "
            "host copies)"
        ),
    )
    p.add_argument(
        "--host-staged",
        action="store_true",
        help="with --transport gloo: exchange through pinned host copies even for CPU tensors",
    )
    p.add_argument(
        "--overlap",
        choices=("auto", "on", "off"),
        default="auto",
        help="overlap pack/unpack with the wire (two staging sets); auto: on for CUDA",
    )
    p.add_argument(
        "--colocated",
        action="store_true",
        help="also run the colocated refit: inference rank d shares training rank d's GPU "
        "(OS shared memory in place of CUDA IPC on CPU; CUDA IPC with --device cuda)",
    )
    p.add_argument("--json", action="store_true")


def add_delta_arguments(p: argparse.ArgumentParser) -> None:
    """``demo`` and ``bench``: delta refit between real optimizer steps."""
    p.add_argument(
        "--delta",
        action="store_true",
        help="Adam steps (BF16 weights, FP32 masters) between refits, and a 'delta' backend: "
        "the reshard plan with each message sent in its smallest form (only what changed); "
        "default backends then reshard,delta",
    )
    p.add_argument("--lr", type=float, default=1e-6, help="with --delta: Adam's learning rate")
    p.add_argument(
        "--anchor-every",
        type=int,
        default=0,
        help="with --delta: a dense refit every N versions (0: only when one is needed)",
    )
    p.add_argument(
        "--delta-kernel",
        choices=["auto", "numba", "numpy"],
        default="auto",
        help="with --delta: how CPU ranks compare and apply — numba's compiled kernels "
        "(the cpu-delta extra), numpy, or auto (numba when installed); same bytes",
    )
    p.add_argument(
        "--delta-check",
        choices=["auto", "on", "off"],
        default="auto",
        help="with --delta: check each delta's base against its receiver's live tensors "
        "every step (engine/delta/check.py); auto: on for GPU ranks, off for CPU ranks",
    )


def run_config(args: argparse.Namespace) -> RunConfig:
    """The run the arguments describe; a ``ValueError`` for a choice no command takes."""
    delta = getattr(args, "delta", False)
    names = args.backends
    if delta and names == "reshard,broadcast":  # the default: delta against dense reshard
        names = "reshard,delta"
    backends = tuple(b.strip() for b in names.split(",") if b.strip())
    for b in backends:
        if b not in BACKENDS:
            raise ValueError(f"unknown backend {b!r}; choose from {', '.join(BACKENDS)}")
    if ("delta" in backends) != delta:
        raise ValueError("the delta backend goes with --delta (and --delta with it)")
    if delta and getattr(args, "lr", 1e-6) <= 0:
        raise ValueError(f"--lr {args.lr} must be > 0")
    if args.steps < 1:
        raise ValueError("--steps must be >= 1")
    relay = args.relay
    if relay is None:
        relay = "auto" if args.command == "simulate" else "none"
    if relay in CLUSTER_RELAYS and args.command != "simulate":
        raise ValueError(
            f"--relay {relay} needs a cluster model (which ranks share NVLink): "
            "use it with simulate"
        )
    colocated = getattr(args, "colocated", False)
    if colocated and args.transport != "gloo":
        raise ValueError(
            "--colocated runs over gloo (with --device cuda on GPUs, the staging shared by "
            "CUDA IPC): the local runner puts several ranks on one GPU, which NCCL refuses"
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
        infer_engine=args.infer_engine,
        transport=args.transport,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
        relay=relay,
        overlap={"auto": None, "on": True, "off": False}[args.overlap],
        colocated=colocated,
        device=args.device,
        host_staged=True if args.host_staged else None,
        delta=delta,
        lr=getattr(args, "lr", 1e-6),
        anchor_every=getattr(args, "anchor_every", 0),
        delta_kernel=getattr(args, "delta_kernel", "auto"),
        delta_check={"auto": None, "on": True, "off": False}[getattr(args, "delta_check", "auto")],
    )
