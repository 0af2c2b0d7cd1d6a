"""The cupy-nccl transport's own init path under a real CuPy wheel, on a machine without
a GPU (run with the Python of ``.venv-cupy13`` / ``.venv-cupy14``,
``scripts/setup_cupy_cpu.sh``):

    python -m tests.programs.cupy_init_path RESULT.json

Two refit ranks (threads) share the NCCL id through a real ``TCPStore``
(``share_unique_id``: rank 0 publishes, rank 1 decodes it for its CuPy) and open the
communicator (``open_communicator``) until the first CUDA call fails. Records, per rank,
the id's type and length, and the error: its type and message, and its cause's (CuPy's
own ``NcclError`` / ``CUDARuntimeError`` where the path is right; a ``TypeError`` where
the id has the wrong form); plus ``cupy_available()`` and its reason.
"""

from __future__ import annotations

import datetime
import json
import sys
import threading
from typing import Any

import torch.distributed as dist
from cupy.cuda import nccl

from nemo_refit_reshard.engine.cupy_nccl import (
    cupy_available,
    cupy_unavailable_reason,
    open_communicator,
    share_unique_id,
)
from nemo_refit_reshard.engine.rendezvous import free_port

WORLD = 2
TIMEOUT_S = 30.0


def _error(err: BaseException | None) -> dict[str, str] | None:
    if err is None:
        return None
    return {"type": type(err).__name__, "module": type(err).__module__, "message": str(err)}


def run_rank(rank: int, port: int, stores: dict[int, dist.Store], out: dict[int, Any]) -> None:
    """One rank's init path: its store connection (kept in ``stores``: rank 0's hosts
    the store the others still read), the id, the communicator."""
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout, wait_for_workers=False)
    stores[rank] = store
    record: dict[str, Any] = {}
    try:
        uid = share_unique_id(store, nccl, rank, WORLD, TIMEOUT_S)
        record["uid"] = {"type": type(uid).__name__, "len": len(uid)}
        open_communicator(nccl, uid, rank, WORLD, 0, TIMEOUT_S)
        record["error"] = None
    except Exception as err:  # noqa: BLE001 - recorded for the test to judge
        record["error"] = _error(err)
        record["cause"] = _error(err.__cause__)
    out[rank] = record


def main() -> None:
    # First: CuPy 13 raises on the first is_available() without a driver, then caches False.
    reason = cupy_unavailable_reason()
    available = cupy_available()
    port = free_port()
    out: dict[int, Any] = {}
    stores: dict[int, dist.Store] = {}
    threads = [threading.Thread(target=run_rank, args=(r, port, stores, out)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result = {
        "ranks": [out.get(r) for r in range(WORLD)],
        "cupy_available": available,
        "reason": reason,
    }
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
