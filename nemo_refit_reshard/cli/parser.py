"""The argument parser: every command, its arguments and the function that runs it."""

from __future__ import annotations

import argparse

from . import models, plan
from .delta_predict import add_delta_prediction_arguments
from .run_args import add_delta_arguments, add_run_arguments

DESCRIPTION = """Command line: ``nemo-refit-reshard <command>``.

``layout`` prints one rank's local tensors and the canonical pieces in each;
``models`` lists the bundled presets; ``plan``, ``demo`` and ``bench`` build and
run refits.
"""


def make_parser() -> argparse.ArgumentParser:
    """``nemo-refit-reshard``'s parser; each command sets ``func``, the function to run."""
    parser = argparse.ArgumentParser(prog="nemo-refit-reshard", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    # The order commands are added in is the order ``--help`` lists them in.
    add_layout_parser(sub)
    mod = sub.add_parser("models", help="list the bundled model presets")
    mod.set_defaults(func=models.cmd_models)
    add_plan_parser(sub)
    demo = sub.add_parser("demo", help="refit between local processes, reshard vs broadcast")
    add_run_arguments(demo, steps=3)
    add_delta_arguments(demo)
    demo.set_defaults(func=cmd_demo)
    bench = sub.add_parser("bench", help="like demo with more steps; --json for the figures")
    add_run_arguments(bench, steps=10)
    add_delta_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    add_simulate_parser(sub)
    add_gpu_check_parser(sub)
    return parser


def add_layout_parser(sub: argparse._SubParsersAction) -> None:
    """``layout``: one rank of one framework's layout."""
    lay = sub.add_parser("layout", help="print one rank's local tensors and canonical pieces")
    lay.add_argument("--framework", choices=models.FRAMEWORKS, required=True)
    lay.add_argument("--model", required=True, help="preset name or path to a config.json")
    lay.add_argument(
        "--parallel",
        default="",
        help="megatron: tp=,pp=,vpp=,cp=,dp=,ep=,etp=; vllm: tp=,pp=,dp=,engine_dp=,ep=; "
        "sglang: tp=,dp=,ep= (ep: --ep-size, 1 or tp); dtensor: dp=,tp=",
    )
    lay.add_argument("--rank", type=int, default=0)
    lay.add_argument("--json", action="store_true", help="print JSON instead of text")
    lay.add_argument("--filter", help="only tensors whose name contains this text")
    meg = lay.add_argument_group("megatron options")
    meg.add_argument("--layer-spec", choices=("local", "te"), default="local")
    meg.add_argument("--grouped-gemm", action="store_true", help="expert names weight{i}")
    meg.add_argument("--vocab-divisible-by", type=int, default=128)
    meg.add_argument("--first-stage-layers", type=int, default=None)
    meg.add_argument("--last-stage-layers", type=int, default=None)
    vll = lay.add_argument_group("vllm options")
    vll.add_argument(
        "--pp-partition",
        help="layers per stage, as VLLM_PP_LAYER_PARTITION / SGLANG_PP_LAYER_PARTITION",
    )
    vll.add_argument(
        "--vllm-version", help="vLLM release to follow (default: the installed one, else 0.33)"
    )
    vll.add_argument(
        "--all2all-backend", help="vLLM's all2all_backend (decides sequence-parallel MoE)"
    )
    lay.set_defaults(func=models.cmd_layout)


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    """``plan``: build the plan, print its figures, optionally write it."""
    p = sub.add_parser("plan", help="build the transfer plan and print its stats")
    add_run_arguments(p, steps=1)
    p.add_argument("--out", help="write the plan JSON here")
    p.add_argument(
        "--delta",
        action="store_true",
        help="also report a delta refit's baselines and scratch per rank, in the peak",
    )
    p.add_argument(
        "--delta-baseline",
        choices=("device", "host"),
        default="device",
        help="with --delta: where training ranks keep their baselines (DeltaOptions."
        "baseline); forwarding inference ranks keep theirs in host memory either way",
    )
    p.set_defaults(func=plan.cmd_plan, fast_exit=True)


def add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    """``simulate``: the plan's predicted time on a cluster model."""
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
    add_delta_prediction_arguments(simulate)
    simulate.set_defaults(func=plan.cmd_simulate, fast_exit=True)


def add_gpu_check_parser(sub: argparse._SubParsersAction) -> None:
    """``gpu-check``: the GPU paths measured on one GPU."""
    gpu = sub.add_parser(
        "gpu-check", help="the GPU paths on one GPU: NCCL, pack/unpack, overlap (needs CUDA)"
    )
    gpu.add_argument("--repeats", type=int, default=5)
    size = gpu.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_const",
        const=True,
        default=None,
        help="a small model instead of DeepSeek-V3 (the default on cards under 100 GB)",
    )
    size.add_argument(
        "--full", dest="quick", action="store_const", const=False, help="DeepSeek-V3 on any card"
    )
    gpu.set_defaults(func=cmd_gpu_check)


def cmd_gpu_check(args: argparse.Namespace) -> int:
    """Run ``gpu-check``, importing it only then: it loads the engine's compiled programs,
    which no other command needs."""
    from .gpu_check import cmd_gpu_check as run_gpu_check

    return run_gpu_check(args)


def cmd_demo(args: argparse.Namespace) -> int:
    """Run ``demo``, importing the local runner only then: it loads torch, which the
    planning commands do without (a second and more of every ``simulate``)."""
    from .run import cmd_demo as run_demo

    return run_demo(args)


def cmd_bench(args: argparse.Namespace) -> int:
    """Run ``bench``, importing the local runner only then (see :func:`cmd_demo`)."""
    from .run import cmd_bench as run_bench

    return run_bench(args)
