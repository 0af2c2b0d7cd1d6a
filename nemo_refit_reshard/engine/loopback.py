"""A transport for one rank alone: sends drain into a sink, receives fill from a pattern.

For device checks of one rank's compiled program (``cli/gpu_check.py``): the program runs
exactly as in a refit — same staging views, same copies — while the "wire" is a copy
per message. On CUDA those copies run on the transport's own stream, ordered after the
packs by an event, so the wire works while the host packs the next round, as a NIC
would; ``wait`` polls its completion event and orders the caller's stream after it. On
CPU they run synchronously in ``start_exchange``.

What a receive gets is a pure function of (peer, message size, round of the step):
after ``new_step()`` the same pattern again, so serial and overlapped replays must leave
identical tensors.
"""

from __future__ import annotations

import torch

from .transport import Messages, Transport


class LoopbackTransport(Transport):
    rank = 0
    world_size = 1

    def __init__(self, device: torch.device | str, largest_message: int, timeout_s: float = 60):
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        g = torch.Generator().manual_seed(1234)
        # The receive pattern: random bytes, shifted by peer and round.
        pattern = torch.randint(0, 256, (largest_message + 4096,), dtype=torch.uint8, generator=g)
        self.pattern = pattern.to(self.device)
        self.sink = torch.empty(largest_message, dtype=torch.uint8, device=self.device)
        self.rounds = 0
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def new_step(self) -> None:
        """Start the receive patterns from round 0 again."""
        self.rounds = 0

    def start_exchange(
        self,
        sends: Messages,
        recvs: Messages,
        round_index: int = 0,
    ) -> _Pending:
        shift = self.rounds % 4096
        self.rounds += 1
        if self.stream is None:
            self._copy(sends, recvs, shift)
            return _Pending(None, self.timeout_s)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            self._copy(sends, recvs, shift)
        done = torch.cuda.Event()
        done.record(self.stream)
        return _Pending(done, self.timeout_s)

    def _copy(self, sends, recvs, shift: int) -> None:
        for _peer, buf in sends:
            self.sink[: buf.numel()].copy_(buf)
        for peer, buf in recvs:
            at = (shift + 7 * peer) % 4096
            buf.copy_(self.pattern[at : at + buf.numel()])

    def all_gather_object_str(self, value: str) -> list[str]:
        return [value]

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Pending:
    def __init__(self, done: torch.cuda.Event | None, timeout_s: float) -> None:
        self.done, self.timeout_s = done, timeout_s

    def wait(self) -> None:
        if self.done is None:
            return
        self.done.synchronize()  # a local copy: it cannot hang on a peer
        torch.cuda.current_stream().wait_event(self.done)
