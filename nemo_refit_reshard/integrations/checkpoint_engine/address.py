"""The refit group's rendezvous: where its store listens (a free port on this node's IP,
or a configured IP) and the run's secret, made together by :func:`group_rendezvous`.

The veRL and NeMo RL checkpoint engines and NeMo RL's weight synchronizer all host the
refit group's store at one process's IP; in a Ray job that is the node's IP as Ray
knows it (reachable from the other nodes), in a local run the loopback. Only the process
that hosts the store picks its port, on its own node: no other node can bind that IP
(veRL: the master actor rank; NeMo RL's synchronizer: policy rank 0; NeMo RL's
checkpoint engine, whose workers do not know their rank when they offer one: every
worker offers :func:`offered_rendezvous`, the driver takes policy rank 0's).
"""

from __future__ import annotations

import errno

from ...engine.rendezvous import Rendezvous, new_rendezvous


def node_address() -> str:
    """This node's IP in the Ray cluster, or ``127.0.0.1`` without Ray (a local run)."""
    try:
        import ray
    except ImportError:  # no Ray installed: a local run
        return "127.0.0.1"
    return str(ray.util.get_node_ip_address()) if ray.is_initialized() else "127.0.0.1"


def group_rendezvous(ip: str | None = None) -> Rendezvous:
    """The refit group's rendezvous (:func:`~nemo_refit_reshard.engine.rendezvous.
    new_rendezvous`): a port free now on ``ip``, or on :func:`node_address` when no IP is
    configured, and a new secret."""
    return new_rendezvous(ip or node_address())


def offered_rendezvous(ip: str | None = None) -> Rendezvous | None:
    """What a worker offers when every worker offers a rendezvous and one of them is used:
    :func:`group_rendezvous`, or None when ``ip`` is set and is another node's IP (a
    worker there offers it; the group then refuses, by name, if none did)."""
    try:
        return group_rendezvous(ip)
    except OSError as err:
        if ip is not None and err.errno == errno.EADDRNOTAVAIL:
            return None
        raise
