"""Delta refit through vLLM's weight-transfer API (``ReshardTrainerInitInfo(delta=True)``)
and the vLLM worker that loses its weights (``integrations/vllm/discarded_weights.py``).

The end-to-end test is a Ray job under vLLM 0.33's Python
(``tests/programs/vllm_delta_refit.py``): 2 trainer ranks holding the policy's BF16
tensors, vLLM's own trainer/worker factories, client and ``Worker`` methods, one tp=2
engine of vLLM's Qwen3 class in BF16. The hook tests need no vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from nemo_refit_reshard.integrations.vllm import (
    refit_forget_weights,
    watch_weights,
)
from nemo_refit_reshard.integrations.vllm.worker import _STATE
from nemo_refit_reshard.spec import InferParallel
from tests.helpers import vllm_env
from tests.helpers.model_configs import MODELS
from tests.helpers.requires import requires
from tests.helpers.vllm_jobs import rank_fields


class Refit:
    def __init__(self) -> None:
        self.forgot = 0

    def forget_version(self) -> None:
        self.forgot += 1


class Worker:
    """vLLM's ``Worker`` methods that lose weights (or not), recording their calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        setattr(self, _STATE, SimpleNamespace(refit=Refit()))

    def sleep(self, level: int = 1) -> str:
        self.calls.append(("sleep", level))
        return "slept"

    def discard(self, tags: tuple[str, ...]) -> None:
        self.calls.append(("discard", tags))

    def reload_weights(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("reload_weights", kwargs))

    def reset_weights(self) -> None:
        self.calls.append(("reset_weights", None))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))


def forgot(worker: Worker) -> int:
    return getattr(worker, _STATE).refit.forgot


def test_watched_worker_forgets_on_calls_that_lose_its_weights() -> None:
    """As vLLM dispatches them (by name on the worker): level 2 sleep, a discard of the
    weights, a reload and a reset forget before vLLM's method runs; level 1 sleep (the
    weights come back), a KV-cache discard and a wake do not. vLLM's methods still run,
    with their arguments and results."""
    worker = Worker()
    assert watch_weights(worker) == ["sleep", "discard", "reload_weights", "reset_weights"]
    assert watch_weights(worker) == ["sleep", "discard", "reload_weights", "reset_weights"]
    expected = 0
    for method, args, kwargs, loses in [
        ("sleep", (), {}, False),
        ("sleep", (1,), {}, False),
        ("sleep", (), {"level": 2}, True),
        ("sleep", (2,), {}, True),
        ("discard", (("kv_cache",),), {}, False),
        ("discard", (("weights", "kv_cache"),), {}, True),
        ("discard", (), {"tags": "weights"}, True),
        ("reload_weights", (), {"weights_path": "/x"}, True),
        ("reset_weights", (), {}, True),
        ("wake_up", (), {"tags": ["weights"]}, False),
    ]:
        result = getattr(worker, method)(*args, **kwargs)
        expected += loses
        assert forgot(worker) == expected, (method, args, kwargs)
        assert worker.calls[-1][0] == method
        if method == "sleep":
            assert result == "slept"
    assert worker.calls[2] == ("sleep", 2)


def test_forget_reaches_the_weight_transfer_engine() -> None:
    """``refit_forget_weights`` (a ``collective_rpc`` callable) reaches the refit of the
    worker functions and of its ``reshard`` weight-transfer engine; a worker that has
    joined nothing forgets nothing."""
    worker = Worker()
    engine = SimpleNamespace(**{_STATE: SimpleNamespace(refit=Refit())})
    worker.weight_transfer_engine = engine  # type: ignore[attr-defined]
    assert refit_forget_weights(worker) == 2
    assert forgot(worker) == 1 and getattr(engine, _STATE).refit.forgot == 1
    assert refit_forget_weights(SimpleNamespace(weight_transfer_engine=None)) == 0


def by_name(updates: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {u["name"]: u for u in updates}


def total(stats: list[dict[str, Any]], key: str) -> int:
    return sum(s[key] for s in stats)


@pytest.mark.slow
@requires(vllm_env.skip_reason)
def test_delta_through_vllm_weight_transfer(tmp_path: Path) -> None:
    """Separate pools: 4 updates bit-exact, the first dense, the next 3 under a fifth of
    the dense bytes, every worker applying patches. Worker 1's level-2 sleep (through
    the hook vLLM's ``init_worker_extension`` installs) and worker 0's poisoned weights
    with ``refit_forget_weights`` each make the next update dense to that worker only,
    bit-exact; poisoned weights *without* forgetting (what ``reload_weights`` or a sleep
    without the hook leave) are found by the per-step base check
    (``engine/delta/check.py``): dense to that worker, bit-exact (before the check they
    were patched into garbage; ``tests/test_delta_check.py`` keeps that control).
    Colocated after that: 3 updates bit-exact, the first dense (new hosts),
    then fewer bytes than dense. Bad delta options are refused by name."""
    infer = InferParallel(tp=2)
    spec = dict(
        config=MODELS["qwen3"],
        seed=700,
        infer=[rank_fields(infer, d, None) for d in range(infer.world_size)],
    )
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = vllm_env.start("vllm_delta_refit", str(tmp_path / "spec.json"), str(tmp_path / "out"))
    vllm_env.finish(proc, "the Ray delta refit job")
    out = json.loads((tmp_path / "out").read_text())
    assert "error" not in out, out.get("traceback")
    assert out["refusals"] == [
        "ReshardTrainerInitInfo.delta='yes' must be True or False",
        "ReshardTrainerInitInfo.delta_anchor_every / delta_baseline / delta_check apply to "
        "delta refits only; set delta=True, or drop them",
        "ReshardTrainerInitInfo: delta anchor_every=-1 must be >= 0",
        "ReshardTrainerInitInfo: delta baseline='gpu': choose one of ['auto', 'device', 'host']",
    ]
    u = by_name(out["updates"])
    for name, update in u.items():
        assert update["differ"] == [[], []], (name, update["differ"])
    for k, name in enumerate(["v1", "v2", "v3", "v4"]):
        trainers, workers = u[name]["trainers"], u[name]["workers"]
        assert [s["version"] for s in trainers + workers] == [k] * 4
        sent, dense = total(trainers, "sent_bytes"), total(trainers, "dense_bytes")
        if k == 0:
            assert sent > dense and all(set(s["forms"]) == {"dense"} for s in trainers)
            continue
        assert 0 < sent < dense / 5, (name, sent, dense)
        assert all(set(w["received"]) - {"dense"} for w in workers), workers
    # worker 1 slept at level 2 (forgot by the hook), worker 0 at level 1 (kept).
    w0, w1 = u["after_sleep"]["workers"]
    assert set(w1["received"]) == {"dense"} and set(w0["received"]) - {"dense"}, (w0, w1)
    assert out["forgot"] == 1
    w0, w1 = u["after_forget"]["workers"]
    assert set(w0["received"]) == {"dense"} and set(w1["received"]) - {"dense"}, (w0, w1)
    w0, w1 = u["unforgotten"]["workers"]
    assert set(w1["received"]) == {"dense"} and set(w0["received"]) - {"dense"}, (w0, w1)
    for k, name in enumerate(["c1", "c2", "c3"]):
        trainers = u[name]["trainers"]
        assert u[name]["workers"] == [None, None]  # a colocated worker unpacks staging
        sent, dense = total(trainers, "sent_bytes"), total(trainers, "dense_bytes")
        assert [s["version"] for s in trainers] == [k] * 2
        assert dense > 0
        if k:
            assert sent < dense / 5, (name, sent, dense)
    assert out["llm_version"] == "c3"


@requires(vllm_env.skip_reason)
def test_vllm_workers_take_the_extension_and_have_the_watched_methods() -> None:
    """vLLM 0.33's GPU and CPU ``Worker``: none of the extension's attributes is theirs
    (vLLM asserts that when it injects ``worker_extension_cls``), and every method
    ``watch_weights`` wraps is theirs (a renamed one would silently go unwatched)."""
    import subprocess

    code = (
        "import json\n"
        "from vllm.v1.worker.gpu_worker import Worker\n"
        "from vllm.v1.worker.cpu_worker import CPUWorker\n"
        "from nemo_refit_reshard.integrations.vllm import ReshardWorkerExtension as E\n"
        "from nemo_refit_reshard.integrations.vllm.discarded_weights import LOSES_WEIGHTS\n"
        "print(json.dumps({W.__name__: [[a for a in dir(E) if not a.startswith('__') and "
        "hasattr(W, a)], [m for m in LOSES_WEIGHTS if not callable(getattr(W, m, None))]] "
        "for W in (Worker, CPUWorker)}))\n"
    )
    python = vllm_env.vllm_python()
    assert python is not None
    out = subprocess.run(
        [python, "-c", code], env=vllm_env.vllm_env(), capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "Worker": [[], []],
        "CPUWorker": [[], []],
    }
