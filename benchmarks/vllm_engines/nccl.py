"""``nccl``: vLLM's broadcast engine, packed and not.

Every worker receives every tensor (``nccl_engine.receive_weights``); packed chunks follow
``packed_tensor.pack_tensors`` (reproduced: it needs CUDA streams)."""

from __future__ import annotations

from benchmarks.vllm_engines.common import Case, Figures, held_numel


def packed_chunks(sizes: list[int], buffer_size: int) -> list[int]:
    """Chunk sizes ``packed_tensor.pack_tensors`` forms (packed_tensor.py:126: a chunk
    takes tensors until its total exceeds ``buffer_size_bytes``; the consumer,
    ``packed_nccl_broadcast_consumer``, cuts at the same point)."""
    chunks, cur = [], 0
    for s in sizes:
        cur += s
        if cur > buffer_size:
            chunks.append(cur)
            cur = 0
    if cur:
        chunks.append(cur)
    return chunks


def nccl_figures(case: Case) -> dict[str, Figures]:
    """``nccl (unpacked)`` and ``nccl (packed)``, in that order.

    Every worker receives the whole model. The single sender, trainer rank 0
    (NCCLTrainerWeightTransferEngine.trainer_init: owners[0] must be the sender),
    materializes every full tensor from iter_full(): it gathers what it does not hold.
    Staging, both sides: unpacked, at least the largest tensor; packed,
    ``DEFAULT_PACKED_NUM_BUFFERS`` buffers of the largest chunk :func:`packed_chunks`
    forms."""
    from vllm.distributed.weight_transfer.packed_tensor import (
        DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        DEFAULT_PACKED_NUM_BUFFERS,
    )

    nbytes, dtype = case.nbytes, case.dtype
    rank0 = case.held[0]
    gather0 = sum(
        nbytes[t.name]
        - held_numel(rank0.get(t.name, []), (0,) * len(t.shape), t.shape) * dtype[t.name].itemsize
        for t in case.tensors
    )
    model_bytes, total = case.model_bytes, case.model_bytes * case.num_workers
    largest = max(nbytes.values())
    chunks = packed_chunks([nbytes[t.name] for t in case.tensors], DEFAULT_PACKED_BUFFER_SIZE_BYTES)
    packed_stage = DEFAULT_PACKED_NUM_BUFFERS * max(chunks)
    return {
        "nccl (unpacked)": Figures(
            model_bytes, total, gather0, largest, largest, ["staging: >= 1 tensor"]
        ),
        "nccl (packed)": Figures(model_bytes, total, gather0, packed_stage, packed_stage, []),
    }
