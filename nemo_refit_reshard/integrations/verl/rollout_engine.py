"""Which engine veRL's rollout workers serve through, and how its adapter consumes yields.

The checkpoint engine is handed only ``engine_kwargs.reshard`` (not the rollout config),
so ``infer_engine`` is a setting of its own. A rollout worker's process does know its
engine: veRL's ``CheckpointEngineWorker.__init__`` builds the server adapter of
``rollout.name`` (``get_rollout_class``, which imports that adapter's module) before the
first ``prepare()``. Every rollout worker reports the adapter modules it has loaded;
the driver refuses settings that name another engine, since the wrong one means the
wrong shards (and, with SGLang, rewritten scratch tensors: silently wrong weights).
No veRL import here: the driver-side checks run anywhere.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping

# Where veRL 0.9.1's server adapters live (``verl/workers/rollout/base.py``'s registry).
ADAPTER_MODULES = {
    "vllm": "verl.workers.rollout.vllm_rollout.vllm_rollout",
    "sglang": "verl.workers.rollout.sglang_rollout.sglang_rollout",
}


def loaded_rollout_engines(modules: Mapping[str, object] | None = None) -> list[str]:
    """The engines whose veRL server adapter this process has imported."""
    modules = sys.modules if modules is None else modules
    return [engine for engine, module in ADAPTER_MODULES.items() if module in modules]


def check_rollout_engine(
    infer_engine: str, rollout_metadata: Iterable[Mapping[str, object]], where: str
) -> None:
    """Refuse ``infer_engine`` when a rollout worker serves through exactly one other
    engine's adapter (a worker that reports none or both, e.g. a test stand-in, says
    nothing)."""
    for i, meta in enumerate(rollout_metadata):
        loaded = list(meta.get("rollout_engines") or [])  # type: ignore[call-overload]
        if len(loaded) == 1 and loaded[0] != infer_engine:
            raise ValueError(
                f"rollout worker {i} serves through veRL's {loaded[0]} adapter "
                f"(rollout.name={loaded[0]}) but {where}.infer_engine={infer_engine!r}: set "
                f"{where}.infer_engine={loaded[0]}"
            )


def reuses_scratch(infer_engine: str) -> bool:
    """Whether the rollout adapter is done with each yielded tensor before asking for the
    next, so the engine may rewrite one scratch tensor per shape.

    vLLM: yes. veRL 0.9.1's ``vllm_rollout.ServerAdapter.update_weights`` hands the
    yields to ``BucketedWeightSender.async_send_weights``
    (``vllm_rollout/bucketed_weight_transfer.py``), which copies each tensor into its
    own IPC bucket (``self.buffer[...].copy_(weight)``, stream-ordered before our next
    write) or, when larger than the bucket, sends it and waits for the receiver's
    answer (``_direct_send_large_weight``: ``send_pyobj`` then ``recv``) before pulling
    the next. SGLang: no. ``sglang_rollout.ServerAdapter.update_weights`` collects a
    list of references per bucket (``get_named_tensor_buckets``; its
    ``_compact_for_bucket`` clones only views), then CUDA-IPC-serializes them and SGLang
    reads them later; ranks other than TP rank 0 do not even wait for that read before
    pulling the next bucket."""
    return infer_engine == "vllm"
