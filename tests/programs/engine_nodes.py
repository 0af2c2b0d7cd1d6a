"""The veRL / NeMo RL ``reshard`` checkpoint engines with their workers on distinct nodes
(run with that framework's Python).

    python -m tests.programs.engine_nodes FRAMEWORK CONFIG_DIR RESULT.json

FRAMEWORK: ``verl`` or ``nemo_rl``. Training ranks 0 and 1 on nodes 0 and 1, the rollout
rank on node 2 (``tests/helpers/nodes.py``: each process binds only its own address),
``host`` = node 0 in the engine's settings. Each process builds the framework's engine
class (ours, registered with the framework), runs ``prepare``; this process hands the
metadata around as the framework's driver does (veRL: ``build_topology``; NeMo RL: every
worker's metadata, policy ranks first), and each joins the refit group (collective:
rendezvous, plan compiled). Stand-in: the framework's controller (queues instead of Ray).

RESULT: ``{"ok", "traceback", "joined": [refit ranks], "addresses": what each offered}``.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import torch.multiprocessing as mp

from tests.helpers.nodes import as_node, node

TIMEOUT_S = 600.0
TRAIN, ROLLOUT = 2, 1


def _engine(framework: str, config_dir: str, rank: int) -> Any:
    kwargs = dict(model=config_dir, infer="tp=1", transport="gloo", host=node(0))
    kwargs["timeout_s"] = TIMEOUT_S
    if framework == "verl":
        from nemo_refit_reshard.integrations.verl import ReshardCheckpointEngine

        return ReshardCheckpointEngine(1 << 20, is_master=rank == 0, **kwargs)
    from nemo_refit_reshard.integrations.nemo_rl import ReshardCheckpointEngine

    return ReshardCheckpointEngine(1 << 20, **kwargs)


def party(framework: str, config_dir: str, rank: int, inbox: Any, out: Any) -> None:
    as_node(node(rank))
    try:
        engine = _engine(framework, config_dir, rank)
        out.put(("metadata", rank, engine.prepare()))
        what = inbox.get(timeout=TIMEOUT_S)
        if framework == "verl":
            engine.init_process_group(**what)
        elif rank < TRAIN:
            engine.init_policy_process_group(
                worker_rank=rank, train_world_size=TRAIN, rollout_world_size=ROLLOUT,
                metadata=what,
            )  # fmt: skip
        else:
            engine.init_rollout_process_group(
                rollout_rank=rank - TRAIN, train_world_size=TRAIN, rollout_world_size=ROLLOUT,
                metadata=what,
            )  # fmt: skip
        out.put(("joined", rank, engine.rank.worker.endpoint.group_rank))
        engine.close() if framework == "verl" else engine.rank.close()
    except BaseException:
        out.put(("failed", rank, traceback.format_exc()))


def main(framework: str, config_dir: str, result_path: str) -> int:
    ctx = mp.get_context("spawn")
    world = TRAIN + ROLLOUT
    inboxes, out = [ctx.Queue() for _ in range(world)], ctx.Queue()
    procs = [
        ctx.Process(target=party, args=(framework, config_dir, r, inboxes[r], out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    result: dict[str, Any] = {"ok": False, "traceback": None, "joined": [], "addresses": []}
    try:
        metadata: list[Any] = [None] * world
        for _ in range(world):
            kind, rank, value = out.get(timeout=TIMEOUT_S)
            if kind == "failed":
                raise RuntimeError(f"rank {rank}: {value}")
            metadata[rank] = value
        result["addresses"] = [m.get("address") for m in metadata]
        if framework == "verl":
            from nemo_refit_reshard.integrations.verl import ReshardCheckpointEngine

            actor, rollout = ReshardCheckpointEngine.build_topology(TRAIN, ROLLOUT, metadata)
            per_rank = [{k: v[r] for k, v in actor.items()} for r in range(TRAIN)]
            per_rank += [{k: v[r] for k, v in rollout.items()} for r in range(ROLLOUT)]
        else:
            per_rank = [metadata] * world
        for r in range(world):
            inboxes[r].put(per_rank[r])
        joined = [None] * world
        for _ in range(world):
            kind, rank, value = out.get(timeout=TIMEOUT_S)
            if kind == "failed":
                raise RuntimeError(f"rank {rank}: {value}")
            joined[rank] = value
        result.update(ok=True, joined=joined)
    except BaseException:
        result["traceback"] = traceback.format_exc()
    finally:
        for p in procs:
            p.join(timeout=30 if result["ok"] else 0)
            if p.is_alive():
                p.kill()
        with open(result_path, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
