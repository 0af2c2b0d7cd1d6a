"""The refit group's rendezvous (``engine/rendezvous.py``): a per-run secret, a store
bound to the endpoint's interface, and no pickle anywhere on the wire or in plan files."""

from __future__ import annotations

import datetime
import re
import socket
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from nemo_refit_reshard.engine.rendezvous import (
    RendezvousError,
    free_address,
    free_port,
    new_secret,
    refit_store,
)

PACKAGE = Path(__file__).resolve().parents[1] / "nemo_refit_reshard"


def _host_then(join, secret: str | None, timeout_s: float = 60.0):
    """Rank 0 hosts with ``secret``; ``join(port)`` runs as rank 1 in a thread."""
    port = free_port()
    out: dict = {}

    def joiner() -> None:
        try:
            out["value"] = join(port)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            out["error"] = err

    thread = threading.Thread(target=joiner)
    thread.start()
    host = refit_store("127.0.0.1", port, 0, 2, timeout_s, secret)
    thread.join()
    return host, out


@pytest.mark.parametrize("ip", ["127.0.0.1", "0.0.0.0"])
def test_a_picked_port_is_held_until_its_store_binds_it(ip: str) -> None:
    """The port is held in TIME_WAIT: a socket without ``SO_REUSEADDR`` (as the kernel's
    ephemeral choices are) cannot take it, while a ``TCPStore`` binds it at once."""
    _, port = free_address(ip)
    with socket.socket() as other, pytest.raises(OSError) as err:
        other.bind((ip, port))
    assert err.value.errno == 98  # EADDRINUSE: held, where a merely free port binds
    store = dist.TCPStore(
        ip, port, 1, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    store.set("k", "v")
    assert store.port == port and store.get("k") == b"v"


def test_the_same_secret_joins_and_shares_keys() -> None:
    secret = new_secret()
    host, out = _host_then(lambda p: refit_store("127.0.0.1", p, 1, 2, 60, secret), secret)
    assert "error" not in out, out
    host.set("uid", "nccl-id")
    assert out["value"].get("uid") == b"nccl-id"


@pytest.mark.parametrize(
    "group, joiner, message",
    [
        (
            "s1",
            "s2",
            "refit rank 1: the refit group at 127.0.0.1:{port} rejected this process: its "
            "secret differs from the run's (the endpoint belongs to another run, or was "
            "altered)",
        ),
        (
            "s1",
            None,
            "refit rank 1: the refit group at 127.0.0.1:{port} requires the run's secret and "
            "this endpoint has none; use the endpoint the driver shipped (RefitEndpoint.secret)",
        ),
        (
            None,
            "s2",
            "refit rank 1: the refit group at 127.0.0.1:{port} has no secret but this endpoint "
            "carries one; the endpoint belongs to another run",
        ),
    ],
)
def test_a_wrong_or_missing_secret_is_refused(group, joiner, message) -> None:
    ports: list[int] = []

    def join(port: int):
        ports.append(port)
        return refit_store("127.0.0.1", port, 1, 2, 60, joiner)

    _, out = _host_then(join, group)
    assert isinstance(out.get("error"), RendezvousError), out
    assert str(out["error"]) == message.format(port=ports[0])


def test_an_outsider_cannot_read_the_groups_keys() -> None:
    """Without the secret the key names cannot be computed: a plain client of the same
    TCPStore sees nothing under the names the group uses."""
    secret = new_secret()
    port = free_port()
    host = refit_store("127.0.0.1", port, 0, 2, 60, secret)
    host.set("uid", "nccl-id")
    outsider = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    assert outsider.check(["refit-auth/nonce"])  # the public part of the handshake
    assert not outsider.check(["uid"])
    assert not outsider.check(["refit/uid", "refit-nccl/uid"])


def _other_address() -> str | None:
    """This machine's address on its default route (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("198.51.100.1", 9))
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


@pytest.mark.skipif(_other_address() is None, reason="no non-loopback address here")
def test_the_store_listens_on_the_endpoint_interface_only() -> None:
    port = free_port()
    store = refit_store("127.0.0.1", port, 0, 2, 60, None)
    with socket.socket() as probe:
        probe.settimeout(5)
        assert probe.connect_ex((_other_address(), port)) != 0  # refused elsewhere
    with socket.socket() as probe:
        probe.settimeout(60)
        assert probe.connect_ex(("127.0.0.1", port)) == 0
    assert store.get("refit-auth/proof") == b"-"  # (the store is alive throughout)


def test_no_pickle_in_the_package() -> None:
    """The wire and plan files carry JSON and raw tensor bytes only: no module imports
    pickle or calls an API that pickles (object collectives, torch.load)."""
    banned = re.compile(
        r"\bimport pickle\b|\bpickle\.|cloudpickle|all_gather_object\(|broadcast_object_list"
        r"|gather_object\(|scatter_object_list|send_object_list|recv_object_list|torch\.load\("
    )
    hits = [
        f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if banned.search(line) and not line.lstrip().startswith("#")
    ]
    assert hits == []


def test_rank_zero_shares_text_as_bytes_not_pickles(tmp_path) -> None:
    """``broadcast_text`` (the vLLM trainer engine's port and secret) over a gloo group."""
    from nemo_refit_reshard.engine.rendezvous import broadcast_text

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        text = "29500:" + "ab" * 32
        assert broadcast_text(text) == text
        with pytest.raises(ValueError, match="300 bytes to share, more than 256"):
            broadcast_text("x" * 300)
    finally:
        dist.destroy_process_group()


def _gather_rank(rank: int, path: str, out: str) -> None:
    from nemo_refit_reshard.engine.rendezvous import gather_texts

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=3)
    try:
        texts = gather_texts("" if rank == 1 else f"127.0.0.1:{4000 + rank}")
        with open(f"{out}{rank}", "w") as f:
            f.write("|".join(texts))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_gathers_every_rank_text(tmp_path) -> None:
    """``gather_texts`` (the colocated trainer engine's host addresses), three processes;
    an empty text (a rank hosting no worker) stays empty."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "texts")
    mp.start_processes(
        _gather_rank, args=(str(tmp_path / "init"), out), nprocs=3, start_method="spawn"
    )
    for r in range(3):
        assert (tmp_path / f"texts{r}").read_text() == "127.0.0.1:4000||127.0.0.1:4002"
