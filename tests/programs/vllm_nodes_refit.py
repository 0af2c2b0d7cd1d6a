"""The vLLM-native ``reshard`` backend with every party on its own node (run with vLLM's
Python).

    python -m tests.programs.vllm_nodes_refit SPEC.json RESULT.json

SPEC: ``{"config": HF config, "trainers": S, "tp": D, "colocated": bool, "port",
"secret"}`` (``port``/``secret``: the driver's, in every rank's init info; default
None). Trainer rank ``r`` runs on node ``r`` (``tests/helpers/nodes.py``: 127.0.0.{r+2},
binding only that address), vLLM worker ``d`` on node ``S + d`` (colocated: on its
host's node ``d``). The trainer ranks run ``ReshardTrainerWeightTransferEngine.
trainer_init`` with ``host`` = node 0 (rank 0 picks the port when none is given; over
``torch.distributed`` the others receive it), then ``send_weights("v1")``. Each worker runs our
``ReshardWeightTransferEngine`` phases on the arguments vLLM would hand it.

Stand-ins, for what needs a GPU: the client (``collective_rpc`` to every worker with the
same arguments, waiting for all: queues to the worker processes), and the worker's
model state (vLLM's model cannot be built here without its kernels: the worker state is
the engine layout's tensors, zero-filled, as ``refit_parameters`` would give).

RESULT: ``{"ok", "traceback", "fingerprint", "workers": [{"rank", "rpc_plan_bytes",
"store_plan_bytes", "rpc_bytes", "status", "zeros"}]}``: the plan bytes each worker
received through the RPC arguments and from the store, and how many elements of its
parameters the refit left zero (every trainer tensor is filled with nonzero values) and
how many are vocabulary padding (which no refit writes).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp

from nemo_refit_reshard.engine.program import TORCH_DTYPES
from nemo_refit_reshard.engine.rendezvous import free_address
from tests.helpers.nodes import as_node, node

TIMEOUT_S = 600.0


class StandInClient:
    """vLLM's client as ``collective_rpc`` behaves: every worker gets the same arguments;
    the call returns when all have answered (raising the first failure)."""

    def __init__(self, inboxes: list[Any], outbox: Any) -> None:
        self.inboxes, self.outbox = inboxes, outbox

    def _all(self, method: str, arg: Any = None) -> None:
        for box in self.inboxes:
            box.put((method, json.dumps(arg)))
        answers = [self.outbox.get(timeout=TIMEOUT_S) for _ in self.inboxes]
        failed = [a for a in answers if a is not None]
        if failed:
            raise RuntimeError(failed[0])

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("init", init_info)

    def start_weight_update(self) -> None:
        self._all("start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._all("update", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish")


def _spec(config: dict[str, Any]) -> Any:
    from nemo_refit_reshard.spec import spec_from_hf_config

    return spec_from_hf_config(config, name="nodes")


def trainer(r: int, spec_json: str, port0: int, inboxes: list[Any], outbox: Any, out: Any) -> None:
    import torch.distributed as dist

    from nemo_refit_reshard.integrations.vllm.transfer_sources import FullModuleSource
    from nemo_refit_reshard.integrations.vllm.transfer_trainer import (
        ReshardTrainerInitInfo,
        ReshardTrainerWeightTransferEngine,
    )

    cfg = json.loads(spec_json)
    as_node(node(r))
    try:
        s = cfg["trainers"]
        dist.init_process_group(
            "gloo", init_method=f"tcp://{node(0)}:{port0}", rank=r, world_size=s
        )
        spec = _spec(cfg["config"])
        tensors = {
            t.name: torch.full(t.shape, 1.0 + i / 8, dtype=TORCH_DTYPES[t.dtype])
            for i, t in enumerate(spec)
        }
        source = FullModuleSource(tensors, spec, world_size=s, rank=r)
        info = ReshardTrainerInitInfo(
            rank=r, vllm_parallel={"tp": cfg["tp"]}, vllm_version="0.33.0", host=node(0),
            timeout_s=TIMEOUT_S, colocated=cfg["colocated"], port=cfg.get("port"),
            secret=cfg.get("secret"),
        )  # fmt: skip
        client = StandInClient(inboxes, outbox) if r == 0 else None
        engine = ReshardTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
        engine.send_weights("v1")
        out.put(("trainer", r, engine.plan.fingerprint, None))
        engine.shutdown()
    except BaseException:
        out.put(("trainer", r, None, traceback.format_exc()))


def worker(d: int, spec_json: str, address: str, inbox: Any, outbox: Any, out: Any) -> None:
    from nemo_refit_reshard.integrations.vllm import transfer_worker as tw
    from nemo_refit_reshard.integrations.vllm.config import EngineLayout
    from nemo_refit_reshard.integrations.vllm.worker import _STATE, _WorkerState
    from nemo_refit_reshard.layouts import VllmOptions, vllm_layouts
    from nemo_refit_reshard.spec import InferParallel

    cfg = json.loads(spec_json)
    as_node(address)
    report: dict[str, Any] = {"rank": d, "rpc_plan_bytes": 0, "store_plan_bytes": 0}
    # The plan bytes this worker reads from the store (the code after the fix does).
    take = getattr(tw, "take_text", None)
    if take is not None:

        def counted(*args: Any) -> str:
            text = take(*args)
            report["store_plan_bytes"] += len(text.encode())
            return text

        tw.take_text = counted
    try:
        infer = InferParallel(tp=cfg["tp"])
        options = VllmOptions(vllm_version="0.33.0")
        layout = vllm_layouts(_spec(cfg["config"]), infer, options)[d]
        params = {t.name: torch.zeros(t.shape, dtype=TORCH_DTYPES[t.dtype]) for t in layout.tensors}
        engine = tw.ReshardWeightTransferEngine.__new__(tw.ReshardWeightTransferEngine)
        engine.device = torch.device("cpu")
        engine.weight_version, engine.refit_rank, engine._session = None, None, None
        extra: dict[str, Any] = {}
        if "derived" in {f.name for f in dataclasses.fields(_WorkerState)}:
            from nemo_refit_reshard.integrations.vllm.derived import DerivedWeights

            extra["derived"] = DerivedWeights((), torch.float32, None)  # none to rerun
        state = _WorkerState(
            layout=EngineLayout(infer, options, "0.33.0"), engine_rank=d, params=params,
            **extra,
        )  # fmt: skip
        setattr(engine, _STATE, state)
    except BaseException:
        out.put(("worker", d, None, traceback.format_exc()))
        return
    while True:
        method, arg = inbox.get(timeout=TIMEOUT_S)
        try:
            payload = json.loads(arg)
            if method == "init":
                plan = payload["plan"]
                texts = plan.values() if isinstance(plan, dict) else [plan or ""]
                report["rpc_plan_bytes"] = sum(len(t.encode()) for t in texts)
                report["rpc_bytes"] = len(arg.encode())
                engine.init_transfer_engine(engine.parse_init_info(payload))
            elif method == "start":
                engine.start_weight_update()
            elif method == "update":
                engine.update_weights(payload)
            elif method == "finish":
                engine.finish_weight_update()
                report["status"] = engine.status()
                report["zeros"] = sum(int((p == 0).sum()) for p in params.values())
                report["padding"] = sum(
                    math.prod(box.sizes) for t in layout.tensors for box in t.padding
                )
                outbox.put(None)
                out.put(("worker", d, report, None))
                engine.shutdown()
                return
            outbox.put(None)
        except BaseException:
            outbox.put(traceback.format_exc())
            out.put(("worker", d, None, traceback.format_exc()))
            return


def main(spec_path: str, result_path: str) -> int:
    spec_json = open(spec_path).read()
    cfg = json.loads(spec_json)
    s, d = cfg["trainers"], cfg["tp"]
    ctx = mp.get_context("spawn")
    inboxes = [ctx.Queue() for _ in range(d)]
    outbox, out = ctx.Queue(), ctx.Queue()
    # torch.distributed's own store listens on every address
    port0 = free_address("0.0.0.0")[1]
    procs = [
        ctx.Process(target=trainer, args=(r, spec_json, port0, inboxes, outbox, out))
        for r in range(s)
    ]
    for k in range(d):
        address = node(k) if cfg["colocated"] else node(s + k)
        procs.append(
            ctx.Process(target=worker, args=(k, spec_json, address, inboxes[k], outbox, out))
        )
    for p in procs:
        p.start()
    result: dict[str, Any] = {"ok": True, "traceback": None, "workers": [None] * d}
    fingerprints = []
    for _ in procs:
        kind, rank, value, tb = out.get(timeout=TIMEOUT_S * 2)
        if tb is not None:
            result["ok"], result["traceback"] = False, f"{kind} {rank}: {tb}"
            break
        if kind == "trainer":
            fingerprints.append(value)
        else:
            result["workers"][rank] = value
    for p in procs:
        p.join(timeout=30 if result["ok"] else 0)
        if p.is_alive():
            p.kill()
    result["fingerprint"] = fingerprints[0] if fingerprints else None
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    sys.exit(main(sys.argv[1], sys.argv[2]))
