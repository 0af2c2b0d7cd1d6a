"""What crosses the wire in a refit into a block-FP8 engine: e4m3 + scales where a
training rank holds whole blocks, the trained dtype elsewhere.

A block-FP8 weight ``W`` (``[R, C]``, blocks ``bm × bn``) is a function of its blocks
only: block ``(i, j)`` of the e4m3 weight and scale ``(i, j)`` depend on
``W[i·bm:(i+1)·bm, j·bn:(j+1)·bn]`` and nothing else (``engine/quantize.py``). So a
training rank whose piece of ``W`` covers whole blocks — its box starts on a block
boundary in both dimensions and ends on one or at the tensor's edge — can quantize it
itself and send e4m3 bytes plus one float32 per block: ~0.5× the BF16 bytes, and
bit-equal to quantizing the whole canonical weight. A weight some training rank holds
off the blocks (a TP or FSDP shard that cuts a block) crosses in the trained dtype and
each inference rank quantizes what it received (its shards are whole blocks: vLLM
requires it, ``vllm_fp8.py``).

The choice is per canonical weight (:func:`choose_fp8_wire`), closed over fused
inference tensors: vLLM's ``qkv_proj`` or ``w13_weight`` is one e4m3 tensor with one
scale tensor, written either as e4m3 or through one trained-dtype shadow, so if one of
its weights must cross unquantized all of them do.

:func:`wire_layouts` rewrites both sides for the planner:

* a training rank gets, per piece of an FP8-wire weight, a derived e4m3 tensor and a
  derived float32 scale tensor (``Fp8Link`` with ``source``: what to quantize); its
  live tensors lose those pieces;
* an inference rank keeps its e4m3 tensors and scales where every weight in them is
  FP8-wire, and holds the others as trained-dtype shadows (``Fp8Link`` without
  ``source``) whose scales it computes.

:func:`wire_spec` is the canonical model as it crosses the wire, which the planner
plans.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..spec.model import CanonicalTensor, ModelSpec
from ..spec.quantization import FP8, SCALE_SUFFIX, cdiv, scale_name
from .base import Box, Fp8Link, LocalTensor, Piece, RankLayout


def whole_blocks(box: Box, shape: tuple[int, ...], block: tuple[int, int]) -> bool:
    """Whether ``box`` of a 2-D weight of ``shape`` is a union of whole blocks (the last
    row or column of blocks may be partial where the weight ends)."""
    for o, s, n, b in zip(box.offsets, box.sizes, shape, block):
        if o % b or ((o + s) % b and o + s != n):
            return False
    return True


def scale_box(box: Box, block: tuple[int, int]) -> Box:
    """The block scales of a whole-block ``box`` of a weight."""
    (r, c), (nr, nc) = box.offsets, box.sizes
    bm, bn = block
    return Box((r // bm, c // bn), (cdiv(nr, bm), cdiv(nc, bn)))


@dataclass(frozen=True)
class Fp8Wire:
    """Which e4m3 weights of a block-FP8 model cross the wire quantized."""

    block: tuple[int, int]
    quantized: frozenset[str]  # sent as e4m3 + scales, quantized by training ranks
    unquantized: dict[str, str] = field(default_factory=dict)  # weight -> why not

    def __str__(self) -> str:
        n = len(self.quantized) + len(self.unquantized)
        text = f"{len(self.quantized)} of {n} FP8 weights cross the wire as e4m3 + scales"
        if self.unquantized:
            first = min(self.unquantized)
            text += (
                f"; {len(self.unquantized)} in the trained dtype, quantized by the "
                f"inference ranks (e.g. {first}: {self.unquantized[first]})"
            )
        return text


def choose_fp8_wire(
    spec: ModelSpec,
    sources: list[RankLayout],
    destinations: list[RankLayout],
    quantize: bool = True,
) -> Fp8Wire:
    """Per e4m3 weight of ``spec``: FP8 on the wire iff every training rank holds it in
    whole blocks and so does every weight it is fused with on an inference rank
    (module docstring). ``quantize=False``: every weight in the trained dtype (the
    shape of NeMo RL's own generation-side quantization; a baseline)."""
    quant = spec.arch.quant
    if quant is None:
        raise ValueError(f"model {spec.name!r} is not block-FP8 quantized")
    fp8 = {t.name: t.shape for t in spec if t.dtype == FP8}
    if not quantize:
        why = "the trained dtype on the wire was asked for"
        return Fp8Wire(quant.block, frozenset(), dict.fromkeys(sorted(fp8), why))
    split: dict[str, str] = {}
    for lay in sources:
        for p in lay.pieces():
            shape = fp8.get(p.canonical)
            if shape is None or p.canonical in split:
                continue
            if not whole_blocks(p.canonical_box, shape, quant.block):
                box = p.canonical_box
                split[p.canonical] = (
                    f"training rank {lay.rank} holds rows {box.offsets[0]}+{box.sizes[0]}, "
                    f"columns {box.offsets[1]}+{box.sizes[1]}: not whole "
                    f"{quant.block[0]}x{quant.block[1]} blocks"
                )
    changed = bool(split)
    while changed:  # a fused inference tensor crosses one way (module docstring)
        changed = False
        for lay in destinations:
            for t in lay.tensors:
                if t.dtype != FP8:
                    continue
                names = {p.canonical for p in t.pieces}
                bad = names & split.keys()
                if bad and not names <= split.keys():
                    why = f"fused with {min(bad)} in {t.name}"
                    split.update(dict.fromkeys(names - split.keys(), why))
                    changed = True
    return Fp8Wire(quant.block, frozenset(fp8.keys() - split.keys()), split)


def quantizing_source(layout: RankLayout, wire: Fp8Wire, dtype: str) -> RankLayout:
    """A training rank that quantizes its whole-block pieces of ``wire.quantized``: each
    such piece moves from its live tensor to a derived e4m3 tensor (``box`` of the live
    tensor, cast to ``dtype``, quantized) with a derived scale tensor."""
    if not wire.quantized:
        return layout
    tensors: list[LocalTensor] = []
    derived: list[LocalTensor] = []
    for t in layout.tensors:
        kept: list[Piece] = []
        for p in t.pieces:
            if p.canonical not in wire.quantized:
                kept.append(p)
                continue
            box = p.canonical_box
            rows, cols = box.sizes
            name = f"{p.canonical}@{box.offsets[0]},{box.offsets[1]}"
            scale = scale_name(p.canonical)
            sbox = scale_box(box, wire.block)
            scale_local = f"{scale}@{box.offsets[0]},{box.offsets[1]}"
            link = Fp8Link(scale_local, wire.block, dtype, t.name, p.local_box)
            full = Box.full((rows, cols))
            derived.append(
                LocalTensor(
                    name, (rows, cols), FP8, (Piece(p.canonical, box, name, full),), fp8=link
                )
            )
            sfull = Box.full(sbox.sizes)
            derived.append(
                LocalTensor(
                    scale_local, sbox.sizes, "float32", (Piece(scale, sbox, scale_local, sfull),)
                )
            )
        tensors.append(t if len(kept) == len(t.pieces) else replace(t, pieces=tuple(kept)))
    return replace(layout, tensors=tuple(tensors + derived))


def wire_destination(layout: RankLayout, wire: Fp8Wire, dtype: str) -> RankLayout:
    """An inference rank of a block-FP8 engine as the refit writes it: e4m3 tensors whose
    weights are all FP8-wire stay (with their scales); the others become ``dtype`` shadows
    (``Fp8Link`` naming their scale) and their scale tensors take no pieces."""
    tensors: list[LocalTensor] = []
    emptied: set[str] = set()
    for t in layout.tensors:
        if t.dtype == FP8 and not all(p.canonical in wire.quantized for p in t.pieces):
            scale = scale_name(t.name)
            tensors.append(replace(t, dtype=dtype, fp8=Fp8Link(scale, wire.block, dtype)))
            emptied.add(scale)
        else:
            tensors.append(t)
    if emptied:
        tensors = [replace(t, pieces=()) if t.name in emptied else t for t in tensors]
    return replace(layout, tensors=tuple(tensors))


def wire_layouts(
    spec: ModelSpec,
    sources: list[RankLayout],
    destinations: list[RankLayout],
    dtype: str | None = None,
    quantize: bool = True,
) -> tuple[list[RankLayout], list[RankLayout], Fp8Wire]:
    """Both sides of a refit into a block-FP8 engine as the planner takes them, and the
    wire choice (module docstring). ``dtype``: the engine's unquantized dtype (default:
    the model's), the dtype shadows and quantizing training ranks work in."""
    dtype = dtype or spec.unquantized().arch.dtype
    wire = choose_fp8_wire(spec, sources, destinations, quantize)
    sources = [quantizing_source(s, wire, dtype) for s in sources]
    destinations = [wire_destination(d, wire, dtype) for d in destinations]
    return sources, destinations, wire


def live_layout(layout: RankLayout) -> RankLayout:
    """The rank as it holds its tensors: a training rank's derived pieces back in the
    live tensors they are quantized from, without the derived tensors; an inference
    rank's shadows as their live e4m3 tensors (their scales keep no pieces: the rank
    computes them). A layout :func:`wire_layouts` did not touch is itself."""
    if not any(t.fp8 is not None for t in layout.tensors):
        return layout
    back: dict[str, list[Piece]] = {}
    derived: set[str] = set()
    for t in layout.tensors:
        link = t.fp8
        if link is not None and link.source is not None and link.box is not None:
            derived |= {t.name, link.scale}
            (p,) = t.pieces
            back.setdefault(link.source, []).append(
                Piece(p.canonical, p.canonical_box, link.source, link.box)
            )
    tensors = []
    for t in layout.tensors:
        if t.name in derived:
            continue
        if t.fp8 is not None:  # a shadow
            t = replace(t, dtype=FP8, fp8=None)
        if t.name in back:
            t = replace(t, pieces=t.pieces + tuple(back[t.name]))
        tensors.append(t)
    return replace(layout, tensors=tuple(tensors))


def live_tensors(layout: RankLayout) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype) of what the rank holds live (:func:`live_layout`): what a
    framework's worker reports."""
    return {t.name: (t.shape, t.dtype) for t in live_layout(layout).tensors}


def wire_spec(spec: ModelSpec, destinations: list[RankLayout]) -> ModelSpec:
    """The canonical model as it crosses the wire to ``destinations``
    (:func:`wire_destination`'s): FP8-wire weights e4m3 with their scales, the rest in
    the trained dtype without scales. An unquantized ``spec`` is itself."""
    if spec.arch.quant is None:
        return spec
    shadowed = {
        p.canonical
        for lay in destinations
        for t in lay.tensors
        if t.fp8 is not None
        for p in t.pieces
    }
    trained = spec.unquantized()
    tensors: list[CanonicalTensor] = []
    for t in spec:
        if t.dtype == FP8 and t.name in shadowed:
            tensors.append(trained.tensor(t.name))
        elif t.name.endswith(SCALE_SUFFIX) and t.name[: -len(SCALE_SUFFIX)] + "weight" in shadowed:
            continue
        else:
            tensors.append(t)
    return ModelSpec(spec.name, spec.arch, tuple(tensors))


__all__ = [
    "Fp8Wire",
    "choose_fp8_wire",
    "live_layout",
    "live_tensors",
    "quantizing_source",
    "scale_box",
    "whole_blocks",
    "wire_destination",
    "wire_layouts",
    "wire_spec",
]
