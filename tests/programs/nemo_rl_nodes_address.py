"""NeMo RL's ``reshard`` synchronizer with its parties on distinct nodes (NeMo RL's Python).

    python -m tests.programs.nemo_rl_nodes_address RESULT.json

The driver (this process) is node 5; policy ranks 0, 1, 2 are Ray actors on nodes 0, 1,
2 (``tests/helpers/nodes.py``: each binds only its own address), with ``refit.host`` =
node 0. The real ``ReshardWeightSynchronizer._endpoint`` picks the refit group's address;
then each policy rank joins it through the real ``ReshardPolicyWorkerMixin.reshard_join``
and the group passes a barrier. Stand-ins: NeMo RL's worker group (the two calls the
synchronizer makes, as ``tests/programs/nemo_rl_driver.py``'s) and the Megatron model
(a policy rank with no tensors: only the rendezvous is under test).

RESULT: ``{"ok", "traceback", "host", "joined": [refit ranks]}``.
"""

from __future__ import annotations

import json
import sys
import traceback
from types import SimpleNamespace
from typing import Any

import ray

from tests.helpers.nodes import as_node, node


@ray.remote
class PolicyRank:
    def __init__(self, rank: int) -> None:
        from nemo_refit_reshard.integrations.nemo_rl.policy_worker import (
            ReshardPolicyWorkerMixin,
        )

        class Worker(ReshardPolicyWorkerMixin):
            def _reshard_live(self) -> dict[str, Any]:
                return {}

        as_node(node(rank))
        self.worker = Worker()
        self.worker.rank = rank

    def reshard_address(self, host: str | None = None) -> tuple[str, int]:
        return self.worker.reshard_address(host)

    def join(self, endpoint_json: str) -> int:
        rank = self.worker.reshard_join(endpoint_json)
        self.worker._reshard.worker.barrier()
        self.worker.reshard_close()
        return rank


class WorkerGroup:
    def __init__(self, actors: list) -> None:
        self.actors = actors

    def run_all_workers_single_data(self, method: str, **kwargs: Any) -> list:
        return [getattr(a, method).remote(**kwargs) for a in self.actors]

    def run_single_worker_single_data(self, method: str, worker_idx: int, **kwargs: Any):
        return getattr(self.actors[worker_idx], method).remote(**kwargs)


def main(result_path: str) -> int:
    result: dict[str, Any] = {"ok": False, "traceback": None}
    try:
        ray.init(num_cpus=4, include_dashboard=False)
        from nemo_refit_reshard.integrations.nemo_rl.config import RefitConfig
        from nemo_refit_reshard.integrations.nemo_rl.synchronizer import (
            ReshardWeightSynchronizer,
        )

        actors = [PolicyRank.remote(r) for r in range(3)]
        as_node(node(5))  # after Ray's own start-up: the driver is node 5 from here
        refit = RefitConfig(backend="reshard", transport="gloo", timeout_s=300.0, host=node(0))
        policy = SimpleNamespace(worker_group=WorkerGroup(actors))
        sync = ReshardWeightSynchronizer(policy, None, {}, refit)
        endpoint = sync._endpoint(3)
        result["host"] = json.loads(endpoint)["host"]
        result["joined"] = ray.get([a.join.remote(endpoint) for a in actors], timeout=600)
        result["ok"] = True
    except BaseException:
        result["traceback"] = traceback.format_exc()
    finally:
        with open(result_path, "w") as f:
            json.dump(result, f)
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
