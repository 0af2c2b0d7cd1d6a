"""vLLM's control plane for the weight-transfer tests, on CPU, with the stand-ins named.

The trainer drives the engine with vLLM's own ``RayVLLMWeightSyncClient``, which calls
``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` / ``update_weight_version`` on a Ray actor holding an ``LLM``.
Those methods are vLLM's ``RLOfflineMixin`` (the mixin ``LLM`` inherits them from); they
run here on :class:`CpuLLM`, whose engine is the stand-in.

Stand-ins, for what cannot start on CPU (an ``LLMEngine`` needs a GPU platform):

* :class:`StandInEngineCore`: the ``llm_engine`` that ``RLOfflineMixin`` calls. Its
  ``collective_rpc`` runs the method on every worker rank (each a Ray actor) and waits for
  all of them, as vLLM's executor does; it keeps the weight version as
  ``LLMEngine.set_weight_version`` does.
* :class:`StandInWorker`: the object vLLM's own ``Worker`` weight-update methods run on
  (they are copied onto it unchanged: their session state and order checks are vLLM's).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

# vLLM's own weight-update methods of its ``Worker``, run on the stand-in as they run on
# the real worker.
VLLM_WORKER_METHODS = (
    "_check_weight_transfer_engine",
    "_start_weight_update",
    "init_weight_transfer_engine",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
    "shutdown_weight_transfer_engine",
)


class StandInWorker:
    """What vLLM's ``Worker`` weight-update methods read from the worker."""

    def __init__(self, engine: Any, vllm_config: Any, rank: int) -> None:
        self.weight_transfer_engine = engine
        self.vllm_config = vllm_config
        self.rank = rank
        self._weight_update_active = False
        self._weight_update_is_draft = False
        self.model_runner = SimpleNamespace(reset_lora_state=lambda: None)

    def get_draft_model(self) -> None:
        return None


def install_vllm_worker_methods() -> None:
    """Give :class:`StandInWorker` vLLM's own ``Worker`` methods (vLLM must be importable)."""
    from vllm.v1.worker.gpu_worker import Worker

    for name in VLLM_WORKER_METHODS:
        setattr(StandInWorker, name, getattr(Worker, name))


class StandInEngineCore:
    """``collective_rpc`` over worker-rank Ray actors (each has ``execute(method, kwargs)``)."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers
        self.weight_version: str | None = None

    def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs: Any = None
    ) -> list[Any]:
        import ray

        calls = [w.execute.remote(method, *args, **(kwargs or {})) for w in self.workers]
        return ray.get(calls, timeout=timeout)

    def set_weight_version(self, version: str) -> None:
        self.weight_version = version

    def get_weight_version(self) -> str | None:
        return self.weight_version


def cpu_llm_class() -> type:
    """``CpuLLM``: vLLM's ``RLOfflineMixin`` over a :class:`StandInEngineCore` (a class
    made on call, so that this module imports without vLLM)."""
    from vllm.entrypoints.rl.offline import RLOfflineMixin

    class CpuLLM(RLOfflineMixin):
        """The RL half of vLLM's ``LLM``: its methods, this engine."""

        def __init__(self, workers: list[Any]) -> None:
            self.llm_engine = StandInEngineCore(workers)

        def rpc(self, method: str, **kwargs: Any) -> list[Any]:
            """A test's own call on every worker rank (status, inspection)."""
            return self.llm_engine.collective_rpc(method, kwargs=kwargs)

    return CpuLLM
