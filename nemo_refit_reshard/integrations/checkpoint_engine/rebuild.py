"""Rollout side of a full-tensor checkpoint engine: the full-shape tensors vLLM's
loader takes, rebuilt from the pieces of its shard a rollout rank received.

A rollout rank receives only its shard's elements and rebuilds, per canonical tensor it
holds a piece of, a full-shape tensor whose pieces hold the received values: vLLM's
loader reads exactly those elements (``tests/test_vllm_truth.py`` proves it for every
piece; SGLang's reads the same ones, ``tests/test_sglang_truth.py``).

Whether a yielded tensor may be overwritten after the consumer asks for the next one
depends on the consumer (``reuse_scratch``): vLLM's adapter copies each tensor into its
own bucket as it arrives, SGLang's holds a whole bucket of references (and SGLang reads
them later, over CUDA IPC), so it needs a distinct tensor per name.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from ...layouts import Box
from ...plan import RankPlan


def canonical_tensors(
    slice_: RankPlan,
    local: Mapping[str, torch.Tensor],
    shapes: Mapping[str, tuple[int, ...]],
    reuse_scratch: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """For a rollout rank: each canonical tensor it received a piece of (sorted by name),
    full-shape, with the received values at their canonical boxes. Other elements are
    unspecified (zeros, or a previous tensor's values): the engine's loader never reads
    them for this rank.

    ``reuse_scratch=True``: one scratch tensor per shape and dtype, rewritten for every
    name; the consumer must copy or load each tensor before asking for the next (veRL's
    vLLM adapter and NeMo RL's vLLM route do). ``False``: a fresh zero tensor per name,
    never written after it is yielded, for consumers that hold several (veRL's SGLang
    adapter holds a bucket of them before SGLang reads any)."""
    boxes: dict[str, list[tuple[Box, str, Box]]] = {}
    me = slice_.group_rank
    for m in slice_.messages:
        if m.dst != me:
            continue
        for t in m.transfers:
            boxes.setdefault(t.canonical, []).append((t.canonical_box, t.dst_tensor, t.dst_box))
    scratch: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}
    for name in sorted(boxes):
        first = local[boxes[name][0][1]]
        key = (tuple(shapes[name]), first.dtype)
        out = scratch.get(key) if reuse_scratch else None
        if out is None:
            out = torch.zeros(key[0], dtype=first.dtype, device=first.device)
            if reuse_scratch:
                scratch[key] = out
        for cbox, tensor, dbox in boxes[name]:
            out[cbox.slices()] = local[tensor][dbox.slices()].reshape(cbox.sizes)
        yield name, out
