"""NeMo RL's colocated refit (``policy.generation.colocated.enabled: true``, Megatron
policy, vLLM generation), read from NVIDIA-NeMo/RL (``git show HEAD:<file>``):

* ``nemo_rl/algorithms/grpo.py`` ``refit_policy_generation``: with colocated inference,
  ``buffer_size_bytes = refit_buffer_size_gb`` GiB if set, else
  ``policy.get_free_memory_bytes() * NRL_REFIT_BUFFER_MEMORY_RATIO`` (default ``0.3``;
  the least free memory over training workers, after ``offload_before_refit``); then
  ``policy.stream_weights_via_ipc_zmq`` and ``policy_generation.update_weights_via_ipc_zmq``.
* ``nemo_rl/models/policy/workers/megatron_policy_worker.py``
  ``stream_weights_via_ipc_zmq``: every training rank runs the whole Megatron-Bridge
  export (``_iter_params_with_optional_kv_scales`` -> ``export_hf_weights``;
  ``export.py``) and streams it to the vLLM worker on its own GPU (ZMQ socket
  ``ipc:///tmp/<GPU UUID>.sock``, ``base_policy_worker.get_zmq_address``).
* ``nemo_rl/models/policy/utils.py`` ``stream_weights_via_ipc_zmq_impl``: two ping-pong
  CUDA buffers of ``buffer_size_bytes // 2`` each (512-byte aligned), every yielded
  tensor copied in (``pack_tensor``), a buffer's CUDA IPC handle sent when full.
* ``nemo_rl/models/generation/vllm/vllm_backend.py`` ``update_weights_via_ipc_zmq``:
  the worker opens the handle (no copy), views every full tensor in it and calls
  ``model.load_weights`` (``_load_full_hf_weights``), whose weight loaders narrow each
  full tensor to the worker's shard and copy that into its parameters.
"""

from __future__ import annotations

from benchmarks.colocated.common import Case, Figures, loaded_bytes
from benchmarks.colocated.export import export

RUNTIME_BUFFER = "0.3 × free GPU memory"


def nemo_rl_figures(case: Case) -> Figures:
    """Per GPU ``g``: interconnect = the export's gathers; copies = the export's copies +
    packing every yielded tensor + the worker's ``load_weights``; materialized = the
    export's; extra memory = the two IPC buffers (a fraction of free memory: needs a
    GPU) + the largest export task's buffers."""
    net, copied, materialized, transient = [], [], [], []
    for g in range(case.num_gpus):
        e = export(case, g)
        net.append(e.received)
        packed = sum(b for _, b in e.stream)
        copied.append(e.copies + packed + loaded_bytes(case.destinations[g]))
        materialized.append(e.materialized)
        transient.append(e.peak_transient)
    return Figures(
        net_total=sum(net),
        net_max=max(net),
        copied_max=max(copied),
        materialized_max=max(materialized),
        extra_max=max(transient),
        extra_runtime=RUNTIME_BUFFER,
        notes=["every GPU streams the whole model; the worker keeps its shard"],
    )
