"""The refit group's rendezvous address: a free port on this node (or a configured host).

The veRL and NeMo RL checkpoint engines and NeMo RL's weight synchronizer all host the
refit group's store at one process's address; in a Ray job that is the node's address
as Ray knows it (reachable from the other nodes), in a local run the loopback. Only the
process that hosts the store picks its port, on its own node: no other node can bind
that address (veRL: the master actor rank; NeMo RL's synchronizer: policy rank 0; NeMo
RL's checkpoint engine, whose workers do not know their rank when they offer one: every
worker offers :func:`offered_address`, the driver takes policy rank 0's).
"""

from __future__ import annotations

import errno

from ...engine.rendezvous import free_address


def node_address() -> str:
    """This node's address in the Ray cluster, or ``127.0.0.1`` without Ray (a local run)."""
    try:
        import ray
    except ImportError:  # no Ray installed: a local run
        return "127.0.0.1"
    return str(ray.util.get_node_ip_address()) if ray.is_initialized() else "127.0.0.1"


def group_address(host: str | None = None) -> tuple[str, int]:
    """``(host, port)`` for the refit group's store: a port free now on ``host``, or on
    :func:`node_address` when no host is configured."""
    return free_address(host or node_address())


def offered_address(host: str | None = None) -> tuple[str, int] | None:
    """What a worker offers when every worker offers an address and one of them is used:
    :func:`group_address`, or None when ``host`` is set and is another node's address (a
    worker there offers it; the group then refuses, by name, if none did)."""
    try:
        return group_address(host)
    except OSError as err:
        if host is not None and err.errno == errno.EADDRNOTAVAIL:
            return None
        raise
