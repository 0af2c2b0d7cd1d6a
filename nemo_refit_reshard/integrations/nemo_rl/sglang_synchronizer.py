"""``refit.backend: reshard`` with NeMo RL's SGLang generation (``backend: sglang``).

NeMo RL runs SGLang colocated: every SGLang rank shares its GPU with a policy rank. The
refit group is the policy ranks; each hosts the SGLang rank on its GPU, which connects
to it once and, every step, unpacks what its host staged into SGLang's live parameters
in place (``integrations/worker/colocated.py``), as the colocated vLLM route does.

The SGLang side is reached only through each server's HTTP API, as NeMo RL reaches it:
every operation is one ``update_weights_from_tensor`` request of NeMo RL's own worker
actor, ``load_format`` our loader (registered by ``sglang_worker.py``) and the named
tensors one :func:`~..sglang.loader.refit_command` per tp rank, inside SGLang's
weight-update session (``begin_weight_update`` / ``end_weight_update``, where the
server has it). SGLang answers success or failure only, so the plan is made from the
config and the policy workers' reports (``plans.plan_nemo_rl_sglang``) and each SGLang
rank checks its own slice and GPU before it connects.

Every sync keeps NeMo RL's colocated bracket (``offload_before_refit``, wake SGLang's
weights, transfer, ``offload_after_refit``, wake the KV cache) and, after the transfer,
flushes the servers' KV caches (NeMo RL's ``invalidate_kv_cache``), as NeMo RL's own
HTTP refit does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray

from ..sglang.loader import LOADER, serialized_refit_command
from .plans import plan_nemo_rl_sglang
from .sglang_config import SGLANG_DELTA, check_sglang_servers
from .synchronizer import ReshardWeightSynchronizer, gather


class ReshardSGLangWeightSynchronizer(ReshardWeightSynchronizer):
    """NeMo RL weight synchronizer for ``refit.backend: reshard`` with SGLang servers."""

    _delta_refused = SGLANG_DELTA

    def _servers(self) -> list[Any]:
        return list(self._generation.engines)  # the first node's actor of each server

    def _command(
        self, op: str, per_server: list[dict[str, Any]], version: str | None = None
    ) -> list[tuple[str, ray.ObjectRef]]:
        """``op`` on every rank of server ``i`` with ``per_server[i]``, one request each."""
        assert self.plan is not None
        return [
            (
                f"SGLang server {i}",
                server.update_weights_from_tensor.remote(
                    serialized_named_tensors=serialized_refit_command(
                        op, self.plan.infer.tp, **arguments
                    ),
                    load_format=LOADER,
                    flush_cache=False,
                    weight_version=version,
                ),
            )
            for i, (server, arguments) in enumerate(zip(self._servers(), per_server, strict=True))
        ]

    def _each_server(self, method: str) -> list[tuple[str, ray.ObjectRef]]:
        return [
            (f"SGLang server {i}", getattr(server, method).remote())
            for i, server in enumerate(self._servers())
        ]

    @contextmanager
    def _session(self, what: str) -> Iterator[None]:
        """SGLang's weight-update session on every server around ``what``; closed on
        every server however ``what`` ends (a server left in a session refuses the next
        one), also when opening it failed on some."""
        try:
            gather(self._each_server("begin_weight_update"), f"opening SGLang's session for {what}")
            yield
        finally:
            gather(self._each_server("end_weight_update"), f"closing SGLang's session after {what}")

    def init_communicator(self) -> None:
        """Plan on the driver; the policy ranks listen, join their group and accept the
        SGLang rank on their GPU, which connects (one request per server)."""
        servers = self._servers()
        check_sglang_servers(servers)
        reports = gather(self._policy_call("reshard_describe"), "reshard_describe")
        self.plan = plan = plan_nemo_rl_sglang(self._config, self._refit, reports, len(servers))
        print(plan, flush=True)
        t, tp = plan.num_policy, plan.infer.tp
        gpus = [str(r["gpu"]) for r in sorted(reports, key=lambda r: int(r["rank"]))]
        with self._released_on_failure():
            endpoint = self._endpoint(t)
            addresses = self._listen_colocated(plan, endpoint)
            hosts = plan.plan.colocated_hosts
            per_server = []
            for i in range(len(servers)):
                first = t + i * tp
                ranks = [hosts[first - t + k] for k in range(tp)]
                per_server.append(
                    {
                        "endpoint_json": endpoint,
                        "first_rank": first,
                        "addresses": [addresses[h] for h in ranks],
                        "host_gpus": [gpus[h] for h in ranks],
                        "plan": plan.engine_slices(first, tp),
                        "fingerprint": plan.plan.fingerprint,
                    }
                )
            with self._session("connecting the colocated refit"):
                gather(
                    self._policy_call("reshard_colocated_join")
                    + self._command("connect_colocated", per_server),
                    "connecting the colocated refit",
                )

    def _refit_all(self) -> list[Any]:
        """One refit: every policy rank sends, every SGLang rank receives (one request per
        server, ``weight_version`` the step), then the servers' KV caches are flushed."""
        step = self.steps + 1
        servers = len(self._servers())
        with self._session(f"refit step {step}"):
            results = gather(
                self._policy_call("reshard_step")
                + self._command("step", [{"step": step}] * servers, version=str(step)),
                f"refit step {step}",
            )
        if self._generation.invalidate_kv_cache() is False:
            raise RuntimeError(
                "SGLang did not flush its KV cache after the refit (invalidate_kv_cache "
                "returned False; its error is logged above): cached prefixes hold the old "
                "weights' keys and values"
            )
        return results[: self.plan.num_policy] if self.plan is not None else results

    def shutdown(self) -> None:
        """Leave the refit group on every rank (best effort: servers may be gone)."""
        if self.plan is None:
            return
        try:
            servers = len(self._servers())
            with self._session("closing the refit group"):
                gather(
                    self._policy_call("reshard_close") + self._command("close", [{}] * servers),
                    "closing the refit group",
                )
        finally:
            self.plan = None
            self._stale = True
