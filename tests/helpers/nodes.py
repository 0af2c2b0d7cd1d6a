"""Processes standing for nodes, on one machine: each binds only its own node's address.

On Linux every 127.x.y.z address reaches the loopback interface, so parties on
127.0.0.2, 127.0.0.3, ... connect to one another as nodes of a cluster do. What one
machine does not give is the refusal a real node gives when it binds another node's
address (``EADDRNOTAVAIL``): :func:`as_node` adds it, for binds made through Python's
``socket`` (where this package picks ports and hosts its stores). Stand-in, named:
separate network namespaces need privileges this machine's tests do not have; binds made
in C++ (gloo's pairs, torch's ``init_method`` store) are not restricted.
"""

from __future__ import annotations

import errno
import socket

LOCAL = ("127.0.0.1", "0.0.0.0", "")  # every node's own loopback and the wildcard

_real_bind = socket.socket.bind


def as_node(address: str) -> None:
    """From now on this process binds only ``address`` (and its own loopback)."""

    def bind(self: socket.socket, where: object) -> None:
        host = where[0] if isinstance(where, tuple) else None
        if host is not None and host not in (address, *LOCAL):
            raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")
        _real_bind(self, where)

    socket.socket.bind = bind  # type: ignore[method-assign]


def node(i: int) -> str:
    """Node ``i``'s address: ``127.0.0.{i + 2}``."""
    return f"127.0.0.{i + 2}"
