"""Every route's rendezvous with its parties on distinct nodes (#40 items 4 and 9).

Each party is a process on its own loopback address (127.0.0.2, 127.0.0.3, ...), binding
only that address (``tests/helpers/nodes.py``: the refusal a real node gives when it binds
another node's address). Only the process that hosts the refit group's store picks a port,
on its own address; the others receive it.

And the vLLM-native backend's plan payload: vLLM's ``init_weight_transfer_engine`` hands
every worker the same arguments, so they carry no plan slice; each worker reads its own
from the group's store, exactly its slice's bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nemo_refit_reshard.engine.rendezvous import free_address
from tests.helpers import vllm_env
from tests.helpers.model_configs import MODELS
from tests.helpers.nodes import node
from tests.helpers.requires import requires


def _vllm_native(tmp_path: Path, colocated: bool, **address: Any) -> dict[str, Any]:
    spec = {"config": MODELS["qwen3"], "trainers": 2, "tp": 2, "colocated": colocated}
    spec.update(address)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = vllm_env.start(
        "vllm_nodes_refit", str(tmp_path / "spec.json"), str(tmp_path / "out.json")
    )
    vllm_env.finish(proc, "the vLLM-native refit across nodes")
    return json.loads((tmp_path / "out.json").read_text())


def _own_slice_bytes(fingerprint: str, colocated: bool) -> list[int]:
    """The bytes of each worker's own plan slice, planned here as every trainer rank does."""
    from nemo_refit_reshard.integrations.vllm.engine_plan import plan_for_engine
    from nemo_refit_reshard.integrations.vllm.transfer_sources import FullModuleSource
    from nemo_refit_reshard.layouts import VllmOptions
    from nemo_refit_reshard.plan import rank_plan
    from nemo_refit_reshard.spec import InferParallel, spec_from_hf_config

    spec = spec_from_hf_config(MODELS["qwen3"], name="nodes")
    source = FullModuleSource({}, spec, world_size=2, rank=0)
    options = VllmOptions(vllm_version="0.33.0")
    hosts = () if colocated else None
    plan = plan_for_engine(source, InferParallel(tp=2), options, colocated_hosts=hosts)
    assert plan.fingerprint == fingerprint
    return [len(rank_plan(plan, 2 + d).to_json().encode()) for d in range(2)]


@pytest.mark.slow
@requires(vllm_env.skip_reason)
@pytest.mark.parametrize("colocated", [False, True], ids=["separate", "colocated"])
def test_vllm_native_trainer_ranks_on_two_nodes_each_worker_gets_only_its_slice(
    tmp_path: Path, colocated: bool
) -> None:
    """Trainer ranks on nodes 0 and 1 (``host`` = node 0, ``port=None``), workers on nodes
    2 and 3 (colocated: on their hosts' nodes 0 and 1): rank 1 never binds node 0's
    address; one refit commits v1 and writes every element but the vocabulary padding.
    Each worker's plan bytes are exactly its own slice, none in the RPC arguments."""
    r = _vllm_native(tmp_path, colocated)
    assert r["ok"], r["traceback"]
    _check_workers(r, colocated)


@pytest.mark.slow
@requires(vllm_env.skip_reason)
def test_vllm_native_each_worker_receives_only_its_own_plan_slice(tmp_path: Path) -> None:
    """The driver set the port and secret (no port to pick): each worker's plan bytes are
    exactly its own slice, read from the group's store; the RPC arguments carry none."""
    port = free_address(node(0))[1]
    r = _vllm_native(tmp_path, False, port=port, secret="ab" * 32)
    assert r["ok"], r["traceback"]
    _check_workers(r, False)


def _check_workers(r: dict[str, Any], colocated: bool) -> None:
    own = _own_slice_bytes(r["fingerprint"], colocated)
    for d, w in enumerate(r["workers"]):
        assert w["status"]["weight_version"] == "v1" and w["status"]["stale"] is None, w
        assert w["zeros"] == w["padding"], w
        assert (w["rpc_plan_bytes"], w["store_plan_bytes"]) == (0, own[d]), (w, own)
        assert w["rpc_bytes"] < 1024, w  # endpoint, fingerprint, store key


@pytest.mark.slow
@requires(vllm_env.nemo_rl_skip_reason)
def test_nemo_rl_synchronizer_address_is_picked_by_policy_rank_0(tmp_path: Path) -> None:
    """The driver on node 5, policy ranks on nodes 0-2, ``refit.host`` = node 0: policy
    rank 0 picks the port (the driver cannot bind node 0's address), all three join."""
    proc = vllm_env.start(
        "nemo_rl_nodes_address", str(tmp_path / "out.json"), python=vllm_env.nemo_rl_python()
    )
    vllm_env.finish(proc, "NeMo RL's synchronizer across nodes")
    r = json.loads((tmp_path / "out.json").read_text())
    assert r["ok"], r["traceback"]
    assert (r["host"], r["joined"]) == (node(0), [0, 1, 2])


def _engine_nodes(tmp_path: Path, framework: str, python: str | None) -> dict[str, Any]:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(MODELS["qwen3"]))
    out = tmp_path / "out.json"
    proc = vllm_env.start(
        "engine_nodes", framework, str(tmp_path / "model"), str(out), python=python
    )
    vllm_env.finish(proc, f"{framework}'s checkpoint engine across nodes")
    return json.loads(out.read_text())


@pytest.mark.slow
@requires(vllm_env.nemo_rl_skip_reason)
def test_nemo_rl_checkpoint_engine_host_is_bound_by_its_node_only(tmp_path: Path) -> None:
    """``host`` = node 0 in the settings, every worker runs ``prepare``: only the worker on
    node 0 offers an address (the others cannot bind it and offer none); all join it."""
    r = _engine_nodes(tmp_path, "nemo_rl", vllm_env.nemo_rl_python())
    assert r["ok"], r["traceback"]
    assert [a and a[0] for a in r["addresses"]] == [node(0), None, None]
    assert r["joined"] == [0, 1, 2]


@pytest.mark.slow
@requires(vllm_env.verl_skip_reason)
def test_verl_checkpoint_engine_master_alone_picks_the_address(tmp_path: Path) -> None:
    """veRL: the master actor rank (node 0) alone picks the address; all three join."""
    r = _engine_nodes(tmp_path, "verl", vllm_env.verl_python())
    assert r["ok"], r["traceback"]
    assert [a and a[0] for a in r["addresses"]] == [node(0), None, None]
    assert r["joined"] == [0, 1, 2]


def _worker_api_rank(rank: int, inbox: Any, out: Any) -> None:
    """One refit rank of the worker API on node ``rank``: rank 0 picks the group's address
    on its own node (``free_address``) and reports it; every rank joins the endpoint the
    driver ships, and the group passes a barrier."""
    from nemo_refit_reshard.engine.rendezvous import free_address
    from nemo_refit_reshard.integrations.worker import RefitEndpoint, RefitWorker
    from tests.helpers.nodes import as_node

    as_node(node(rank))
    try:
        if rank == 0:
            out.put(("address", free_address(node(0))))
        worker = RefitWorker(RefitEndpoint.from_json(inbox.get(timeout=600)), {})
        worker.join()
        worker.barrier()
        worker.close()
        out.put(("joined", rank))
    except BaseException as err:  # reported to the test
        out.put(("failed", f"rank {rank}: {err!r}"))


@pytest.mark.slow
def test_worker_api_rank_0_picks_its_own_address_and_every_node_joins() -> None:
    """The driver (this process) is node 5: it cannot pick a port on node 0's address (the
    error says who picks it); refit rank 0 does, on node 0, and ranks on nodes 1 and 2
    join it."""
    import dataclasses
    import multiprocessing as mp

    from nemo_refit_reshard.integrations.worker import RefitEndpoint

    ctx = mp.get_context("spawn")
    inboxes, out = [ctx.Queue() for _ in range(3)], ctx.Queue()
    procs = [ctx.Process(target=_worker_api_rank, args=(r, inboxes[r], out)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        kind, value = out.get(timeout=600)
        assert kind == "address", value
        host, port = value
        assert host == node(0)
        endpoint = RefitEndpoint(host, port, 3, 0, secret="cd" * 32)
        for r in range(3):
            inboxes[r].put(dataclasses.replace(endpoint, group_rank=r).to_json())
        done = sorted(out.get(timeout=600) for _ in range(3))
        assert done == [("joined", 0), ("joined", 1), ("joined", 2)], done
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    # The driver's own process, as node 5, cannot pick the port for node 0.
    script = (
        "from tests.helpers.nodes import as_node\n"
        "from nemo_refit_reshard.engine.rendezvous import free_address\n"
        "as_node('127.0.0.7')\n"
        "free_address('127.0.0.2')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "OSError: [Errno 99] cannot pick a port on 127.0.0.2 (Cannot assign requested "
        "address): it is not an address of this node. Only the process hosting the refit "
        "group's store (refit rank 0) picks the port, on its own node's address; the "
        "others receive it"
    )
