"""The ``layout`` and ``models`` commands: one rank's local tensors and the canonical
pieces in each; the bundled model presets."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from typing import Any

from ..layouts import (
    Box,
    MegatronOptions,
    RankLayout,
    VllmOptions,
    dtensor_layout,
    fsdp2_placements,
    fsdp2_tp_placements,
    megatron_layout,
    vllm_layout,
)
from ..layouts.sglang import sglang_layout
from ..spec import (
    InferParallel,
    ModelSpec,
    TrainParallel,
    load_model_spec,
    parse_parallel_string,
    preset_configs,
)

FRAMEWORKS = ("megatron", "vllm", "sglang", "dtensor")


def cmd_layout(args: argparse.Namespace) -> int:
    """Print one rank's layout, as text or as JSON."""
    spec = load_model_spec(args.model)
    layout = build_layout(args, spec)
    if args.json:
        json.dump(layout_json(layout, spec, args.filter), sys.stdout)
        print()
    else:
        print_layout(layout, spec, args.filter)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """Print one line per bundled preset: family, parameters, canonical tensors."""
    for name in sorted(preset_configs()):
        spec = load_model_spec(name)
        print(
            f"{name:18} {spec.arch.family:12} {spec.num_params / 1e9:8.2f}B params  "
            f"{len(spec)} tensors"
        )
    return 0


def build_layout(args: argparse.Namespace, spec: ModelSpec) -> RankLayout:
    """The layout the ``layout`` command's arguments describe."""
    if args.framework == "megatron":
        return megatron_rank_layout(args, spec)
    if args.framework == "vllm":
        return vllm_rank_layout(args, spec)
    if args.framework == "sglang":  # what layouts/sglang.py proves against SGLang
        return sglang_rank_layout(args, spec)
    return dtensor_rank_layout(args, spec)


def megatron_rank_layout(args: argparse.Namespace, spec: ModelSpec) -> RankLayout:
    """``--framework megatron``: the rank's layout with the Megatron options given."""
    opts = MegatronOptions(
        layer_spec=args.layer_spec,
        moe_grouped_gemm=args.grouped_gemm,
        make_vocab_size_divisible_by=args.vocab_divisible_by,
        num_layers_in_first_pipeline_stage=args.first_stage_layers,
        num_layers_in_last_pipeline_stage=args.last_stage_layers,
    )
    return megatron_layout(spec, TrainParallel.parse(args.parallel), args.rank, opts)


def vllm_rank_layout(args: argparse.Namespace, spec: ModelSpec) -> RankLayout:
    """``--framework vllm``: ``--pp-partition`` when given, else the environment's
    ``VLLM_PP_LAYER_PARTITION``."""
    partition = None
    if args.pp_partition:
        partition = tuple(int(x) for x in args.pp_partition.split(","))
    base = VllmOptions(pp_layer_partition=partition) if partition else VllmOptions.from_env()
    opts = replace(base, vllm_version=args.vllm_version, all2all_backend=args.all2all_backend)
    return vllm_layout(spec, InferParallel.parse(args.parallel), args.rank, opts)


def sglang_rank_layout(args: argparse.Namespace, spec: ModelSpec) -> RankLayout:
    """``--framework sglang``: ``--pp-partition`` when given, else the environment's
    ``SGLANG_PP_LAYER_PARTITION`` (SGLang's own variable; its split otherwise)."""
    text = args.pp_partition or os.environ.get("SGLANG_PP_LAYER_PARTITION")
    try:
        partition = tuple(int(x) for x in text.split(",")) if text else None
    except ValueError:
        raise ValueError(f"pp layer partition {text!r} is not a comma list of ints") from None
    parallel = InferParallel.parse(args.parallel)
    return sglang_layout(spec, parallel, args.rank, pp_layer_partition=partition)


def dtensor_rank_layout(args: argparse.Namespace, spec: ModelSpec) -> RankLayout:
    """``--framework dtensor``: FSDP2 over ``dp``, with tensor parallelism when ``tp > 1``."""
    sizes = parse_parallel_string(args.parallel, ("dp", "tp"), "dtensor")
    dp, tp = sizes.get("dp", 1), sizes.get("tp", 1)
    if tp > 1:
        return dtensor_layout(spec, (dp, tp), args.rank, fsdp2_tp_placements(tp))
    return dtensor_layout(spec, (dp,), args.rank, fsdp2_placements((dp,)))


def layout_json(layout: RankLayout, spec: ModelSpec, name_filter: str | None) -> dict[str, Any]:
    """The layout as JSON, with the model's name; only the tensors whose name contains
    ``name_filter`` when one is given."""
    payload = {"model": spec.name, **layout.to_json()}
    if name_filter:
        payload["tensors"] = [t for t in payload["tensors"] if name_filter in t["name"]]
    return payload


def print_layout(layout: RankLayout, spec: ModelSpec, name_filter: str | None) -> None:
    """The layout as text: each local tensor, then the canonical box each local box holds."""
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
            print(f"    {box_text(p.local_box)} <- {p.canonical}{box_text(p.canonical_box)}")
        for pad in t.padding:
            print(f"    {box_text(pad)} padding")
    total = sum(t.numel for t in layout.tensors)
    print(f"{shown} of {len(layout.tensors)} local tensors shown; {total:,} local elements")


def box_text(box: Box) -> str:
    """``[start:stop, ...]``, one slice per dimension."""
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(box.offsets, box.sizes)) + "]"
