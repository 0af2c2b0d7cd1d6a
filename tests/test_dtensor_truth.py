"""The DTensor provider against ``distribute_tensor`` on real gloo meshes.

Each spawned rank distributes a tensor whose elements are their own global
flat index, so the local shard says exactly which global elements it holds;
the provider's pieces must say the same.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from nemo_refit_reshard.layouts.dtensor import (
    Placement,
    Replicate,
    Shard,
    StridedShard,
    local_index_runs,
    mesh_coordinate,
)

pytestmark = pytest.mark.slow

# (global shape, mesh shape, placements)
CASES: list[tuple[tuple[int, ...], tuple[int, ...], tuple[Placement, ...]]] = [
    ((8, 6), (4,), (Shard(0),)),
    ((10, 3), (4,), (Shard(0),)),  # uneven: 3,3,3,1
    ((5, 3), (4,), (Shard(0),)),  # uneven: 2,2,1,0
    ((2, 3), (4,), (Shard(0),)),  # empty shards
    ((6, 10), (4,), (Shard(1),)),
    ((7,), (4,), (Replicate(),)),
    ((8, 4), (2, 2), (Shard(0), Shard(0))),
    ((8, 4), (2, 2), (StridedShard(0, 2), Shard(0))),  # FSDP2 + TP, colwise
    ((8, 6), (2, 2), (Shard(0), Shard(1))),  # FSDP2 + TP, rowwise
    ((12, 4), (2, 2), (StridedShard(0, 2), Shard(0))),
    ((16, 4), (2, 2), (StridedShard(0, 2), Shard(0))),
    ((6, 5), (2, 2), (Replicate(), Shard(1))),
    ((9, 5), (2, 2), (Shard(1), Shard(0))),
    ((7, 3), (2, 2), (Shard(0), Shard(0))),  # uneven over two axes
]


def _torch_placement(p: Placement):
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, Shard):
        return TS(p.dim)
    if isinstance(p, StridedShard):
        return _StridedShard(p.dim, split_factor=p.split_factor)
    return TR()


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = []
        for shape, mesh_shape, placements in CASES:
            mesh = init_device_mesh("cpu", mesh_shape)
            numel = 1
            for s in shape:
                numel *= s
            full = torch.arange(numel, dtype=torch.float64).reshape(shape)
            dt = distribute_tensor(full, mesh, [_torch_placement(p) for p in placements])
            results.append(dt.to_local().clone())
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _ours(shape, mesh_shape, placements, rank) -> torch.Tensor:
    """Global flat indices of the local shard, as the provider's index runs describe it."""
    runs = local_index_runs(shape, mesh_shape, placements, mesh_coordinate(mesh_shape, rank))
    per_dim = [
        torch.cat([torch.arange(s, s + n) for s, n in dim]) if dim else torch.zeros(0, dtype=int)
        for dim in runs
    ]
    strides = torch.tensor([1] * len(shape))
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    grids = torch.meshgrid(*per_dim, indexing="ij")
    flat = sum(g * int(strides[d]) for d, g in enumerate(grids))
    return flat.to(torch.float64)


@pytest.fixture(scope="module")
def distributed_shards() -> dict[int, list[torch.Tensor]]:
    world = 4
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(
            _worker, args=(world, init_file, tmp), nprocs=world, start_method="spawn"
        )
        return {r: torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)}


@pytest.mark.parametrize("case", range(len(CASES)))
def test_local_shards_match_distribute_tensor(distributed_shards, case: int) -> None:
    shape, mesh_shape, placements = CASES[case]
    for rank in range(4):
        got = distributed_shards[rank][case]
        want = _ours(shape, mesh_shape, placements, rank)
        assert tuple(got.shape) == tuple(want.shape), (rank, got.shape, want.shape)
        assert torch.equal(got, want), rank
