"""The refit group's rendezvous: a ``TCPStore`` on the endpoint's interface, guarded by a
per-run secret.

Refit rank 0 hosts the store, listening on the IP the endpoint names only (not every
interface: the socket is bound first and handed to the store). Where the group meets and
the secret that admits its members are made one way, :func:`new_rendezvous`, by the
process that owns the IP (only it can pick a port there); every route ships the result
with the endpoint. With a secret, rank 0 publishes a random
nonce and ``HMAC(secret, nonce)``; a joining process checks that proof with its own
secret and refuses at once, saying why, when they differ (or when one side has a secret
and the other not). Every key the group then uses lives under a prefix derived from the
secret: a process without it cannot compute the names, so it can neither read the
group's keys (the NCCL unique id among them) nor write them, and cannot take part in
gloo's rendezvous. The secret itself never crosses the wire.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

AUTH_NONCE = "refit-auth/nonce"
AUTH_PROOF = "refit-auth/proof"
NO_SECRET = "-"


class RendezvousError(RuntimeError):
    """This process may not join the refit group (wrong or missing secret)."""


@dataclass(frozen=True)
class Rendezvous:
    """Where a refit group meets, ``ip:port`` (refit rank 0's store), and the secret that
    admits its members (the endpoint's ``host``, ``port`` and ``secret``)."""

    ip: str
    port: int
    secret: str = field(repr=False)


def new_secret() -> str:
    """A per-run secret for the driver to ship with the endpoint (hex, 256 bits)."""
    return secrets.token_hex(32)


def new_rendezvous(ip: str = "127.0.0.1", port: int | None = None) -> Rendezvous:
    """A refit group's rendezvous at ``ip``, with a new secret: at ``port``, or (None) a
    port free on ``ip`` now (:func:`free_address`: only the process that owns ``ip``, the
    one that will host the store, may pick it)."""
    if port is None:
        ip, port = free_address(ip)
    return Rendezvous(ip, port, new_secret())


def free_address(ip: str = "127.0.0.1") -> tuple[str, int]:
    """``(ip, port)`` with a port free on ``ip`` and reserved for about a minute: where a
    refit group's rank 0 (or any ``TCPStore``) can host its store.

    Why reserved: a port merely free when picked can be taken before its store binds it --
    by the kernel's ephemeral choice for another process's outgoing connection or
    ``bind(port 0)`` (gloo's pair listeners, Ray's gRPC), which is how a run fails with
    ``EADDRINUSE``. So the port is left holding a connection in ``TIME_WAIT``: the kernel
    then hands it to no ephemeral request, while a socket that sets ``SO_REUSEADDR``
    (``TCPStore`` does; so does :func:`refit_store`) binds it at once, from any process.

    Only the process on the node that will host the store may call it: ``ip`` must be an
    address of its own node, and no other node can bind it."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((ip, 0))
        except OSError as err:
            raise OSError(
                err.errno,
                f"cannot pick a port on {ip} ({err.strerror}): it is not an address of this "
                "node. Only the process hosting the refit group's store (refit rank 0) picks "
                "the port, on its own node's address; the others receive it",
            ) from err
        listener.listen(1)
        port = int(listener.getsockname()[1])
        with socket.socket(listener.family) as client:
            # A wildcard address ("" or 0.0.0.0: every interface) is reached on loopback.
            client.connect((ip if ip not in ("", "0.0.0.0") else "127.0.0.1", port))
            accepted, _ = listener.accept()
            # The side that closes first keeps TIME_WAIT: the accepted socket, whose local
            # port is the one picked.
            accepted.close()
        return ip, port


def free_port() -> int:
    """A port reserved on the loopback interface (local runs and tests; see
    :func:`free_address`)."""
    return free_address("127.0.0.1")[1]


def _mac(secret: str, message: str) -> str:
    return hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()


def _bound_socket(ip: str, port: int) -> int:
    """A listening socket on ``ip:port`` only; its descriptor, owned by the caller."""
    infos = socket.getaddrinfo(ip, port, type=socket.SOCK_STREAM)
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(1024)
    return sock.detach()


def refit_store(
    ip: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    secret: str | None = None,
) -> dist.Store:
    """The group's store (rank 0 hosts it on ``ip``), authenticated when ``secret`` is
    given; returns a store whose keys are private to holders of the secret."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        fd = _bound_socket(ip, port)
        store = dist.TCPStore(
            ip,
            port,
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=fd,
        )
        nonce = secrets.token_hex(16)
        store.set(AUTH_NONCE, nonce)
        store.set(AUTH_PROOF, _mac(secret, nonce) if secret else NO_SECRET)
    else:
        store = _client(ip, port, world_size, timeout, secret, f"refit rank {rank}")
    return _private(store, secret)


def _client(
    ip: str,
    port: int,
    world_size: int | None,
    timeout: datetime.timedelta,
    secret: str | None,
    who: str,
) -> dist.TCPStore:
    """A client of rank 0's store, after checking that both hold the same secret."""
    store = dist.TCPStore(ip, port, world_size, is_master=False, timeout=timeout)
    nonce = store.get(AUTH_NONCE).decode()
    proof = store.get(AUTH_PROOF).decode()
    where = f"the refit group at {ip}:{port}"
    if proof == NO_SECRET and secret:
        raise RendezvousError(
            f"{who}: {where} has no secret but this endpoint carries one; "
            "the endpoint belongs to another run"
        )
    if proof != NO_SECRET and not secret:
        raise RendezvousError(
            f"{who}: {where} requires the run's secret and this endpoint has "
            "none; use the endpoint the driver shipped (RefitEndpoint.secret)"
        )
    if secret and not hmac.compare_digest(proof, _mac(secret, nonce)):
        raise RendezvousError(
            f"{who}: {where} rejected this process: its secret differs from "
            "the run's (the endpoint belongs to another run, or was altered)"
        )
    return store


def _private(store: dist.Store, secret: str | None) -> dist.Store:
    if not secret:
        return store
    # The group's own keys: names only secret holders can compute.
    return dist.PrefixStore(_mac(secret, "keys")[:32], store)


def store_client(ip: str, port: int, timeout_s: float, secret: str | None, who: str) -> dist.Store:
    """A connection to the store refit rank 0 hosts at ``ip:port``, for a process that
    reads or writes keys outside the group's own traffic (rank 0 publishing each worker's
    plan slice, a worker reading its own): authenticated as :func:`refit_store`'s joiners
    are, and seeing the same secret-derived key names. ``who`` names the caller in
    errors. Waits up to ``timeout_s`` for the store to exist."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return _private(_client(ip, port, None, timeout, secret, who), secret)


def publish_texts(store: dist.Store, key: str, texts: dict[int, str]) -> None:
    """``texts[r]`` under ``key/r``: one value per reader, each read by its reader only."""
    for rank, text in texts.items():
        store.set(f"{key}/{rank}", text.encode())


def take_text(store: dist.Store, key: str, rank: int) -> str:
    """Rank ``rank``'s value under ``key`` (waiting for it, up to the store's timeout),
    removed from the store once read: rank 0's store keeps no copy it no longer needs."""
    text = store.get(f"{key}/{rank}").decode()
    store.delete_key(f"{key}/{rank}")
    return text


def tcp_port(store: dist.Store, fallback: int) -> int:
    """The port a store listens on (rank 0 may have asked for port 0)."""
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    return inner.port if isinstance(inner, dist.TCPStore) else fallback


def gather_texts(text: str) -> list[str]:
    """Every rank's ``text`` (at most 256 bytes each), in rank order, on every rank of the
    default ``torch.distributed`` group; tensor bytes, never pickled objects."""
    import torch

    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = _text_buffer(text, device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return [bytes(p.cpu().tolist()).rstrip(b"\0").decode() for p in parts]


def _text_buffer(text: str, device: Any) -> Any:
    import torch

    buf = torch.zeros(256, dtype=torch.uint8, device=device)
    data = text.encode()
    if len(data) > buf.numel():
        raise ValueError(f"{len(data)} bytes to share, more than {buf.numel()}")
    if data:  # frombuffer refuses an empty buffer
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


def broadcast_text(text: str) -> str:
    """Rank 0's ``text`` on every rank of the default ``torch.distributed`` group, as raw
    bytes in a tensor (never a pickled object: the package sends JSON and tensor bytes
    only). At most 256 bytes: a port and a secret."""
    import torch

    device = torch.device("cpu")
    if dist.get_backend() == "nccl":  # NCCL groups carry CUDA tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _text_buffer(text, device)
    dist.broadcast(buf, src=0)
    return bytes(buf.cpu().tolist()).rstrip(b"\0").decode()
