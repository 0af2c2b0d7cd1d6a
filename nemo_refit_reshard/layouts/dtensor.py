"""PyTorch DTensor layout provider (FSDP2 / DTensor training policies; torch 2.13).

A DTensor policy holds the HF model's own parameters, each sharded over a
device mesh (rank -> coordinate: row-major over ``mesh_shape``, as
``DeviceMesh(torch.arange(world).view(mesh_shape))``). Placements are applied
mesh axis by mesh axis, left to right, to the sequence of global indices along
each tensor dimension:

* ``Shard(d)``: ``torch.chunk`` semantics: for a sequence of length L over n
  ranks, ``c = ceil(L/n)`` and coordinate k keeps ``[min(L, k·c), min(L, (k+1)·c))``
  (trailing ranks may be short or empty).
* ``StridedShard(d, sf)`` (torch's ``_StridedShard``): the sequence is first cut
  into ``sf`` chunks, each chunk is cut into n as above, and coordinate k keeps
  the concatenation of its part of every chunk. This is FSDP2's placement over
  a dimension that tensor parallel already split into ``sf`` shards.
* ``Replicate()``: the whole sequence.

The kept index sequences of all dimensions form a grid of boxes; each box is a
piece (coalesced where global indices are contiguous).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import product

from ..spec.model import CanonicalTensor, ModelSpec
from .base import Box, LayoutBuilder, RankLayout, paused_gc


@dataclass(frozen=True)
class Shard:
    dim: int


@dataclass(frozen=True)
class StridedShard:
    dim: int
    split_factor: int


@dataclass(frozen=True)
class Replicate:
    pass


Placement = Shard | StridedShard | Replicate
Runs = list[tuple[int, int]]  # (global start, length) in local order


def _take(runs: Runs, lo: int, hi: int) -> Runs:
    """Positions ``[lo, hi)`` of the index sequence described by ``runs``."""
    out: Runs = []
    pos = 0
    for start, length in runs:
        a, b = max(lo, pos), min(hi, pos + length)
        if a < b:
            out.append((start + a - pos, b - a))
        pos += length
    return out


def _chunk(length: int, n: int, k: int) -> tuple[int, int]:
    """``torch.chunk`` part k of n of a length-``length`` sequence, as ``[lo, hi)``."""
    size = -(-length // n) if length else 0
    return min(length, k * size), min(length, (k + 1) * size)


def _merge(runs: Runs) -> Runs:
    out: Runs = []
    for start, length in runs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        elif length:
            out.append((start, length))
    return out


def local_index_runs(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> list[Runs]:
    """Per tensor dimension, the global index runs this mesh coordinate holds, in local order."""
    if len(placements) != len(mesh_shape):
        raise ValueError(
            f"{len(placements)} placements for a {len(mesh_shape)}-D mesh; give one per mesh axis"
        )
    runs: list[Runs] = [[(0, n)] for n in shape]
    for axis, placement in enumerate(placements):
        n, k = mesh_shape[axis], coordinate[axis]
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, StridedShard)):
            raise ValueError(f"placement {placement!r} cannot describe a stored parameter")
        d = placement.dim
        if not 0 <= d < len(shape):
            raise ValueError(f"placement {placement} names dim {d} of a {len(shape)}-D tensor")
        length = sum(r[1] for r in runs[d])
        if isinstance(placement, Shard):
            runs[d] = _take(runs[d], *_chunk(length, n, k))
        else:
            kept: Runs = []
            for j in range(placement.split_factor):
                c_lo, c_hi = _chunk(length, placement.split_factor, j)
                lo, hi = _chunk(c_hi - c_lo, n, k)
                kept += _take(runs[d], c_lo + lo, c_lo + hi)
            runs[d] = kept
    return [_merge(r) for r in runs]


def mesh_coordinate(mesh_shape: Sequence[int], rank: int) -> tuple[int, ...]:
    coord = []
    for n in reversed(mesh_shape):
        rank, k = divmod(rank, n)
        coord.append(k)
    return tuple(reversed(coord))


PlacementFn = Callable[[CanonicalTensor], Sequence[Placement]]


def fsdp2_placements(mesh_shape: Sequence[int]) -> PlacementFn:
    """FSDP2 on a 1-D mesh: every parameter ``Shard(0)``."""
    if len(mesh_shape) != 1:
        raise ValueError("fsdp2_placements needs a 1-D mesh (dp,)")
    return lambda t: (Shard(0),)


_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROWWISE = ("o_proj", "down_proj")


def fsdp2_tp_placements(tp: int) -> PlacementFn:
    """FSDP2 × TP on a ``(dp, tp)`` mesh with the usual HF Llama/Qwen TP plan.

    Column-wise q/k/v/gate/up and the vocabulary (embedding, lm_head) are
    ``Shard(0)`` over tp, so FSDP's dim-0 sharding over dp becomes
    ``StridedShard(0, tp)``; row-wise o/down are ``Shard(1)`` over tp; norms are
    replicated over tp.
    """

    def placements(t: CanonicalTensor) -> tuple[Placement, Placement]:
        parts = t.name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        colwise = module in _COLWISE or t.name in ("model.embed_tokens.weight", "lm_head.weight")
        if colwise:
            return (StridedShard(0, tp), Shard(0))
        if module in _ROWWISE and t.name.endswith(".weight"):
            return (Shard(0), Shard(1))
        return (Shard(0), Replicate())

    return placements


@paused_gc
def dtensor_layout(
    spec: ModelSpec,
    mesh_shape: Sequence[int],
    rank: int,
    placements: PlacementFn,
) -> RankLayout:
    """Local shards of every canonical tensor on ``rank`` of a DTensor mesh.

    Local tensor names are the HF names; an empty shard is still a (0-sized)
    local tensor, as DTensor keeps one.
    """
    spec = spec.unquantized()  # the trained weights: never an FP8 checkpoint
    world = 1
    for n in mesh_shape:
        world *= n
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside the mesh {tuple(mesh_shape)} of {world} ranks")
    coord = mesh_coordinate(mesh_shape, rank)
    b = LayoutBuilder()
    for t in spec:
        runs = local_index_runs(t.shape, mesh_shape, placements(t), coord)
        local_shape = tuple(sum(r[1] for r in dim) for dim in runs)
        b.tensor(t.name, local_shape, t.dtype)
        local_starts = []
        for dim in runs:
            starts, pos = [], 0
            for _, length in dim:
                starts.append(pos)
                pos += length
            local_starts.append(starts)
        for choice in product(*(range(len(dim)) for dim in runs)):
            g_off = tuple(runs[d][i][0] for d, i in enumerate(choice))
            sizes = tuple(runs[d][i][1] for d, i in enumerate(choice))
            l_off = tuple(local_starts[d][i] for d, i in enumerate(choice))
            b.piece(t.name, Box(g_off, sizes), t.name, Box(l_off, sizes))
    position = {f"mesh{axis}": k for axis, k in enumerate(coord)}
    return RankLayout(
        framework="dtensor",
        rank=rank,
        world_size=world,
        position=position,
        replicas=_dtensor_replicas(spec, mesh_shape, rank, placements),
        tensors=b.build(),
    )


def _dtensor_replicas(
    spec: ModelSpec,
    mesh_shape: Sequence[int],
    rank: int,
    placements: PlacementFn,
) -> tuple[int, ...]:
    """Ranks that hold exactly the same index runs of every tensor as ``rank``."""
    world = 1
    for n in mesh_shape:
        world *= n
    # Tensors with the same shape and placements shard alike: check each kind once.
    kinds = {(t.shape, tuple(placements(t))) for t in spec}

    def signature(r: int) -> list[list[Runs] | None]:
        coord = mesh_coordinate(mesh_shape, r)
        out: list[list[Runs] | None] = []
        for shape, pl in sorted(kinds, key=repr):
            runs = local_index_runs(shape, mesh_shape, pl, coord)
            out.append(runs if all(runs) else None)  # an empty shard holds nothing
        return out

    mine = signature(rank)
    return tuple(other for other in range(world) if signature(other) == mine)
