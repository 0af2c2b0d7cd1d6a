"""Command line: ``nemo-refit-reshard <command>``.

``layout`` prints one rank's local tensors and the canonical pieces in each;
``models`` lists the bundled presets; ``plan``, ``demo`` and ``bench`` build and
run refits (``cli_refit.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace

from .cli_refit import add_commands
from .layouts import (
    MegatronOptions,
    RankLayout,
    VllmOptions,
    dtensor_layout,
    fsdp2_placements,
    fsdp2_tp_placements,
    megatron_layout,
    vllm_layout,
)
from .layouts.base import Box
from .spec import InferParallel, TrainParallel, load_model_spec, parse_parallel_string
from .spec.model import ModelSpec, preset_configs

FRAMEWORKS = ("megatron", "vllm", "dtensor")


def _box(box: Box) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(box.offsets, box.sizes)) + "]"


def build_layout(args: argparse.Namespace, spec: ModelSpec) -> RankLayout:
    """The layout the ``layout`` command's arguments describe."""
    if args.framework == "megatron":
        opts = MegatronOptions(
            layer_spec=args.layer_spec,
            moe_grouped_gemm=args.grouped_gemm,
            make_vocab_size_divisible_by=args.vocab_divisible_by,
            num_layers_in_first_pipeline_stage=args.first_stage_layers,
            num_layers_in_last_pipeline_stage=args.last_stage_layers,
        )
        return megatron_layout(spec, TrainParallel.parse(args.parallel), args.rank, opts)
    if args.framework == "vllm":
        partition = None
        if args.pp_partition:
            partition = tuple(int(x) for x in args.pp_partition.split(","))
        base = VllmOptions(pp_layer_partition=partition) if partition else VllmOptions.from_env()
        opts_v = replace(base, vllm_version=args.vllm_version, all2all_backend=args.all2all_backend)
        return vllm_layout(spec, InferParallel.parse(args.parallel), args.rank, opts_v)
    sizes = parse_parallel_string(args.parallel, ("dp", "tp"), "dtensor")
    dp, tp = sizes.get("dp", 1), sizes.get("tp", 1)
    if tp > 1:
        return dtensor_layout(spec, (dp, tp), args.rank, fsdp2_tp_placements(tp))
    return dtensor_layout(spec, (dp,), args.rank, fsdp2_placements((dp,)))


def print_layout(layout: RankLayout, spec: ModelSpec, name_filter: str | None) -> None:
    pos = ", ".join(f"{k}={v}" for k, v in layout.position.items())
    print(
        f"{layout.framework} rank {layout.rank} of {layout.world_size} ({pos}); model {spec.name}"
    )
    print(f"replicas (identical pieces): {list(layout.replicas)}")
    shown = 0
    for t in layout.tensors:
        if name_filter and name_filter not in t.name:
            continue
        shown += 1
        print(f"{t.name}  {list(t.shape)} {t.dtype}")
        for p in t.pieces:
            print(f"    {_box(p.local_box)} <- {p.canonical}{_box(p.canonical_box)}")
        for pad in t.padding:
            print(f"    {_box(pad)} padding")
    total = sum(t.numel for t in layout.tensors)
    print(f"{shown} of {len(layout.tensors)} local tensors shown; {total:,} local elements")


def cmd_layout(args: argparse.Namespace) -> int:
    spec = load_model_spec(args.model)
    layout = build_layout(args, spec)
    if args.json:
        payload = {"model": spec.name, **layout.to_json()}
        if args.filter:
            payload["tensors"] = [t for t in payload["tensors"] if args.filter in t["name"]]
        json.dump(payload, sys.stdout)
        print()
    else:
        print_layout(layout, spec, args.filter)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    for name in sorted(preset_configs()):
        spec = load_model_spec(name)
        a = spec.arch
        print(f"{name:18} {a.family:12} {spec.num_params / 1e9:8.2f}B params  {len(spec)} tensors")
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nemo-refit-reshard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    lay = sub.add_parser("layout", help="print one rank's local tensors and canonical pieces")
    lay.add_argument("--framework", choices=FRAMEWORKS, required=True)
    lay.add_argument("--model", required=True, help="preset name or path to a config.json")
    lay.add_argument(
        "--parallel",
        default="",
        help="megatron: tp=,pp=,vpp=,cp=,dp=,ep=,etp=; vllm: tp=,pp=,dp=,engine_dp=,ep=; "
        "dtensor: dp=,tp=",
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
    vll.add_argument("--pp-partition", help="layers per stage, like VLLM_PP_LAYER_PARTITION")
    vll.add_argument(
        "--vllm-version", help="vLLM release to follow (default: the installed one, else 0.33)"
    )
    vll.add_argument(
        "--all2all-backend", help="vLLM's all2all_backend (decides sequence-parallel MoE)"
    )
    lay.set_defaults(func=cmd_layout)

    mod = sub.add_parser("models", help="list the bundled model presets")
    mod.set_defaults(func=cmd_models)
    add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as err:
        print(f"nemo-refit-reshard: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
