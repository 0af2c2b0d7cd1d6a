"""``simulate --plot``: per-GPU bytes and node-to-node traffic as a PNG (matplotlib)."""

from __future__ import annotations

from typing import Any

from ..plan import RefitPlan, Topology, traffic_matrix


def require_matplotlib() -> None:
    """A ``ValueError`` saying how to install matplotlib when it is missing: checked
    before any planning, so a long simulation does not fail at its last step."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib, which is not installed: pip install -e '.[plot]' "
            "(or pip install matplotlib)"
        ) from None


def plot_simulation(plan: RefitPlan, prediction: Any, links: Topology, path: str) -> None:
    """Per-rank bytes sent / received (NVLink and NIC) and the node-to-node traffic matrix.

    ``prediction`` is ``predict_refit``'s result (its ``gpu_bytes`` per rank)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    ranks = list(range(len(prediction.gpu_bytes)))
    sent = [(g.sent_nvlink, g.sent_nic) for g in prediction.gpu_bytes]
    recv = [(g.received_nvlink, g.received_nic) for g in prediction.gpu_bytes]
    width = 0.4
    for shift, rows, label in ((-width / 2, sent, "sent"), (width / 2, recv, "received")):
        xs = [r + shift for r in ranks]
        left.bar(xs, [a / 1e9 for a, _ in rows], width, label=f"{label} NVLink")
        left.bar(
            xs, [b / 1e9 for _, b in rows], width, [a / 1e9 for a, _ in rows], label=f"{label} NIC"
        )
    left.axvline(plan.num_sources - 0.5, color="grey", linestyle=":")
    left.set(xlabel="refit-group rank (training | inference)", ylabel="GB", title="per GPU")
    left.legend()
    nodes = sorted(set(links.placement.nodes))
    matrix = traffic_matrix(plan, links)
    grid = [[matrix.get((a, b), 0) / 1e9 for b in nodes] for a in nodes]
    image = right.imshow(grid, cmap="viridis")
    right.set(xlabel="destination node", ylabel="source node", title="traffic (GB)")
    right.set_xticks(range(len(nodes)), [str(n) for n in nodes])
    right.set_yticks(range(len(nodes)), [str(n) for n in nodes])
    fig.colorbar(image, ax=right)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
