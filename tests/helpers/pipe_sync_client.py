"""A test stand-in for vLLM's control plane: a ``VLLMWeightSyncClient`` over pipes.

vLLM's real clients reach an ``LLM`` / ``AsyncLLM`` (Ray actor, HTTP server), whose
``collective_rpc`` runs each call on every worker of the engine and waits for all. A
real engine cannot start on CPU here, so each vLLM worker rank runs in its own test
process (``tests/programs/vllm_transfer_worker.py``) and this client plays the part of
``collective_rpc``: it sends every call to every worker, then waits for every answer.
Only this transport between test processes is a stand-in; what runs at each end —
vLLM's ``Worker`` weight-update methods, its factory and our engines — is real.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Client, Connection
from typing import Any


class PipeWeightSyncClient:
    """Implements vLLM's ``VLLMWeightSyncClient`` protocol (structural) over sockets."""

    def __init__(
        self, addresses: list[tuple[str, int]], authkey: bytes, connect_timeout_s: float = 400
    ) -> None:
        self.addresses, self.authkey = addresses, authkey
        self.connect_timeout_s = connect_timeout_s
        self._conns: list[Connection] | None = None  # connected on first use (rank 0)

    def call(self, method: str, *args: Any) -> list[Any]:
        """Run ``method`` on every worker (all at once); every worker's result."""
        if self._conns is None:
            self._conns = [self._connect(a) for a in self.addresses]
        for conn in self._conns:
            conn.send((method, args))
        answers = [conn.recv() for conn in self._conns]
        errors = [value for ok, value in answers if not ok]
        if errors:
            raise RuntimeError(f"{method} failed on a worker: {errors[0]}")
        return [value for _, value in answers]

    def _connect(self, address: tuple[str, int]) -> Connection:
        # The worker listens once vLLM is imported: slow on a loaded machine.
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                return Client(address, authkey=self.authkey)
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self.call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("finish_weight_update", weight_version)
