"""vLLM 0.33's ``ipc`` weight-transfer engine
(``vllm/distributed/weight_transfer/ipc_engine.py``), both modes.

Trainer (``IPCTrainerWeightTransferEngine``): ``trainer_init`` refuses a source whose
``owned_names(rank)`` is not every parameter ("IPC needs every trainer rank to own every
parameter") and one without ``iter_full``; every rank exports its own full copies for
the worker on its GPU. For these Megatron layouts that source is the Bridge export
(``export.py``), so the gathers are NeMo RL's (the assumption the table notes).

* unpacked (``IPCTrainerInitInfo.packed = False``, the default): ``_send_unpacked``
  keeps every yielded tensor (``weight_refs``, ``.contiguous()``: no copy for these) until
  the single update after the whole export; the worker rebuilds a view per tensor.
* packed: ``packed_tensor.packed_ipc_producer`` copies tensors into one buffer of
  ``packed_buffer_size_bytes`` (default ``DEFAULT_PACKED_BUFFER_SIZE_BYTES``, 1 GiB),
  raising ``ValueError`` for a tensor larger than it; ``packed_ipc_consumer`` clones
  every tensor out of the chunk on the worker.

Worker (``IPCWeightTransferEngine``): ``start_weight_update`` ->
``initialize_layerwise_reload`` (``model_loader/reload/layerwise.py``): a layer's weights
are buffered until the layer is complete, then ``materialize_layer`` allocates the layer
afresh, the original weight loaders copy the shard into it, and
``_copy_and_restore_kernel_tensors`` copies it into the live parameters (two copies).
"""

from __future__ import annotations

from collections import defaultdict

from benchmarks.colocated.common import Case, Figures, loaded_bytes, param_bytes, vllm_modules
from benchmarks.colocated.export import export
from nemo_refit_reshard.layouts import RankLayout

PACKED_BUFFER = 2**30  # vllm/distributed/weight_transfer/packed_tensor.py


def chunks(stream: list[tuple[str, int]], buffer: int) -> list[list[tuple[str, int]]]:
    """``packed_ipc_producer``'s chunking (a tensor larger than ``buffer`` is refused)."""
    out: list[list[tuple[str, int]]] = [[]]
    total = 0
    for name, nbytes in stream:
        if nbytes > buffer:
            raise ValueError(f"{name}: {nbytes} bytes exceed packed_buffer_size_bytes={buffer}")
        if total and total + nbytes > buffer:
            out.append([])
            total = 0
        out[-1].append((name, nbytes))
        total += nbytes
    return out


def worker_peak_packed(stream: list[tuple[str, int]], buffer: int, layout: RankLayout) -> int:
    """Most worker memory in packed mode: a chunk's clones (alive through its
    ``load_weights``) + clones of earlier chunks buffered for layers not yet complete +
    the layer ``materialize_layer`` allocates when one completes."""
    module_of, needs, size = vllm_modules(layout)
    arrived: dict[str, int] = defaultdict(int)
    buffered: dict[str, int] = {}
    peak = 0
    for chunk in chunks(stream, buffer):
        alive = sum(buffered.values()) + sum(b for _, b in chunk)
        peak = max(peak, alive)
        pending: dict[str, int] = defaultdict(int)
        for name, nbytes in chunk:
            module = module_of.get(name)
            if module is None:
                continue
            pending[module] += nbytes
            arrived[module] += 1
            if arrived[module] == len(needs[module]):
                peak = max(peak, alive + size[module])
                alive -= buffered.pop(module, 0)
                del pending[module]
        for module, nbytes in pending.items():
            buffered[module] = buffered.get(module, 0) + nbytes
    return peak


def vllm_ipc_figures(case: Case, packed: bool) -> Figures:
    """Interconnect and materialized: the export's. Copies: the export's + (packed: into
    the buffer, and the worker's clone) + the worker's two per element. Extra memory:
    unpacked: every new yielded tensor held at once, then the largest vLLM layer
    materialized; packed: the buffer + the largest export task + the worker's peak
    (:func:`worker_peak_packed`; summed, an upper bound)."""
    net, copied, materialized, extra = [], [], [], []
    notes = ["trainer source: the Bridge export (assumed)"]
    if not packed:
        notes.append("every new full tensor held until the one update")
    buffer = PACKED_BUFFER
    streams = [export(case, g) for g in range(case.num_gpus)]
    largest = max(b for e in streams for _, b in e.stream)
    if packed and largest > buffer:
        notes.append(
            f"the default 1 GiB buffer refuses a {largest / 2**30:.2f} GiB tensor "
            "(ValueError); figures with the buffer raised to it"
        )
        buffer = largest
    for g, e in enumerate(streams):
        dst = case.destinations[g]
        worker = loaded_bytes(dst) + param_bytes(dst)
        yielded = sum(b for _, b in e.stream)
        net.append(e.received)
        materialized.append(e.materialized)
        if packed:
            copied.append(e.copies + 2 * yielded + worker)
            peak = worker_peak_packed(e.stream, buffer, dst)
            extra.append(buffer + e.peak_transient + peak)
        else:
            copied.append(e.copies + worker)
            layer = max(vllm_modules(dst)[2].values())
            extra.append(max(e.peak_unpacked, e.held_new + layer))
    return Figures(
        net_total=sum(net),
        net_max=max(net),
        copied_max=max(copied),
        materialized_max=max(materialized),
        extra_max=max(extra),
        notes=notes,
    )
