"""Faults not covered elsewhere (docs/reliability.md has the whole matrix): nobody
listening, a hung peer, a full disk under a plan file."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from nemo_refit_reshard.cli import main
from nemo_refit_reshard.cli.plan import write_plan_file
from nemo_refit_reshard.engine.rendezvous import free_port
from nemo_refit_reshard.engine.transport import GlooTransport, TransportError


@pytest.mark.slow
def test_nobody_listening_is_named_within_the_connect_timeout() -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(TransportError) as err:
        GlooTransport("127.0.0.1", port, 1, 2, timeout_s=600, connect_timeout_s=3)
    assert str(err.value).startswith(
        f"refit rank 1 could not join the gloo group at 127.0.0.1:{port} within 3s ("
    )
    assert time.monotonic() - t0 < 3 + 60  # the connect budget, not the refit timeout


def _hung_peer(rank: int, port: int, out: str) -> None:
    transport = GlooTransport("127.0.0.1", port, rank, 2, timeout_s=5, connect_timeout_s=300)
    if rank == 1:
        time.sleep(60)  # joined, then hangs: never takes part in the exchange
        os._exit(0)
    buf = torch.zeros(16, dtype=torch.uint8)
    t0 = time.monotonic()
    try:
        transport.exchange([(1, buf)], [(1, buf.clone())])
        Path(out).write_text("completed")
    except TransportError as err:
        Path(out).write_text(f"{time.monotonic() - t0:.1f}\n{err}")
    os._exit(0)


@pytest.mark.slow
def test_a_hung_peer_fails_the_others_within_the_timeout(tmp_path) -> None:
    out = str(tmp_path / "rank0.txt")
    ctx = mp.start_processes(
        _hung_peer, args=(free_port(), out), nprocs=2, start_method="spawn", join=False
    )
    deadline = time.monotonic() + 300
    while not Path(out).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in ctx.processes:
        p.kill()
    seconds, message = Path(out).read_text().split("\n", 1)
    assert 5 <= float(seconds) < 5 + 60
    assert message.startswith("refit rank 0: ") and "with rank 1" in message, message
    assert "(timeout 5s)" in message or "within 5" in message, message


def test_a_full_disk_leaves_no_plan_file_behind(tmp_path, monkeypatch, capsys) -> None:
    target = tmp_path / "plan.json"
    real_open = open

    class FullDisk:
        def __init__(self, path, mode):
            self.f = real_open(path, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("builtins.open", lambda p, m="r", *a, **k: FullDisk(p, m))
    with pytest.raises(ValueError) as err:
        write_plan_file(str(target), "x" * 1000)
    monkeypatch.undo()
    assert str(err.value) == (
        f"could not write the plan to {target}: [Errno 28] No space left on device"
    )
    assert list(tmp_path.iterdir()) == []  # neither the plan nor its temporary file
    # a real full device: one line, status 2
    assert main(["plan", "--model", "small-qwen3", "--out", "/dev/full"]) == 2
    assert capsys.readouterr().err.strip() == (
        "nemo-refit-reshard: error: could not write the plan to /dev/full: [Errno 28] No "
        "space left on device"
    )
