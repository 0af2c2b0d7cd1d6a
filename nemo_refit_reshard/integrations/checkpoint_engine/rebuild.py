"""Rollout side of a full-tensor checkpoint engine: the full-shape tensors vLLM's
loader takes, rebuilt from the pieces of its shard a rollout rank received.

A rollout rank receives only its shard's elements and rebuilds, per canonical tensor it
holds a piece of, a full-shape tensor whose pieces hold the received values: vLLM's
loader reads exactly those elements (``tests/test_vllm_truth.py`` proves it for every
piece).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from ...layouts import Box
from ...plan import RankPlan


def canonical_tensors(
    slice_: RankPlan, local: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """For a rollout rank: each canonical tensor it received a piece of, full-shape, with
    the received values at their canonical boxes. Other elements are unspecified (zeros,
    or a previous tensor's values): vLLM's loader never reads them for this rank. One
    scratch tensor per shape and dtype is reused: the consumer must copy or load each
    tensor before asking for the next, as veRL's and NeMo RL's do."""
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
        out = scratch.get(key)
        if out is None:
            out = scratch[key] = torch.zeros(key[0], dtype=first.dtype, device=first.device)
        for cbox, tensor, dbox in boxes[name]:
            out[cbox.slices()] = local[tensor][dbox.slices()].reshape(cbox.sizes)
        yield name, out
