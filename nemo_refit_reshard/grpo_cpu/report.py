"""A GRPO run's step reports (:class:`StepReport`) and their printing and plotting."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

DEFAULT_PLOT = "grpo_cpu.png"


@dataclass(frozen=True)
class StepReport:
    """One GRPO step's outcome: reward, refit time and bytes per backend, the
    generator/trainer log-prob gap (what ``format_step`` prints and the plot draws)."""

    step: int
    reward: float  # mean reward of the step's samples
    refit_seconds: dict[str, float]  # backend -> slowest rank's refit wall time
    refit_bytes: dict[str, int]  # backend -> bytes the plan moves per refit
    max_logprob_diff: float  # max |generator - trainer| log-prob of the sampled tokens
    seconds: float  # wall time of the whole step
    metrics: dict[str, float] = field(default_factory=dict)  # the trainer's train_step stats
    # refit.delta: (bytes sent, bytes the same messages weigh dense), summed over the
    # training actors (payloads and headers sent; dense without headers); else None
    delta_bytes: tuple[int, int] | None = None
    # faults: the generation engines (replicas) that hold the step after its refit
    engines: tuple[int, ...] | None = None


def pop_plot_flag(argv: list[str]) -> str | None:
    """Remove ``--plot [PATH]`` / ``--plot=PATH`` from ``argv`` in place (Hydra would reject
    it) and return the plot path (``DEFAULT_PLOT`` without a path), or None without the
    flag. A following Hydra override (``key=value``) or option is not taken as the path."""
    for i, arg in enumerate(argv):
        if arg.startswith("--plot="):
            del argv[i]
            return arg.split("=", 1)[1] or DEFAULT_PLOT
        if arg == "--plot":
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            take = bool(nxt) and "=" not in nxt and not nxt.startswith("-")
            del argv[i : i + 1 + take]
            return nxt if take else DEFAULT_PLOT
    return None


def _kb(n: int) -> str:
    return f"{n / 1024:.0f} KiB"


def format_step(r: StepReport, backend: str) -> str:
    """One line per step: reward, refit time and bytes per backend (the real one first),
    the trainer/generator log-prob gap and the step's wall time."""
    order = [backend] + [b for b in r.refit_seconds if b != backend]
    refits = "  ".join(
        f"{b} {r.refit_seconds[b] * 1e3:6.1f} ms {_kb(r.refit_bytes[b]):>8}" for b in order
    )
    if r.delta_bytes is not None:
        sent, dense = r.delta_bytes
        refits += f"  delta sent {_kb(sent)} of {_kb(dense)} dense"
    if r.engines is not None:
        refits += f"  engines {','.join(map(str, r.engines))}"
    return (
        f"step {r.step:3d}  reward {r.reward:.3f}  refit {refits}  "
        f"max|Δlogprob| {r.max_logprob_diff:.1e}  step {r.seconds:5.2f} s"
    )


def summary(reports: Sequence[StepReport], backend: str, wall_seconds: float) -> str:
    """First/last reward, median refit time per backend, their ratio, wall time."""
    if not reports:
        return "no steps ran"
    k = min(3, len(reports))
    first = sum(r.reward for r in reports[:k]) / k
    last = sum(r.reward for r in reports[-k:]) / k
    lines = [
        f"{len(reports)} steps in {wall_seconds:.1f} s; reward (mean of {k} steps) "
        f"{first:.3f} -> {last:.3f}; max|Δlogprob| "
        f"{max(r.max_logprob_diff for r in reports):.1e}"
    ]
    times = {b: median(r.refit_seconds[b] for r in reports) for b in reports[0].refit_seconds}
    for b, t in times.items():
        lines.append(
            f"refit {b:9s} median {t * 1e3:6.1f} ms, {_kb(reports[0].refit_bytes[b])} per refit"
        )
    deltas = [r.delta_bytes for r in reports if r.delta_bytes is not None]
    if deltas:
        sent, dense = sum(d[0] for d in deltas), sum(d[1] for d in deltas)
        lines.append(
            f"delta refit: sent {_kb(sent)} of {_kb(dense)} dense over {len(deltas)} steps "
            f"({sent / max(dense, 1):.1%})"
        )
    if "reshard" in times and "broadcast" in times:
        lines.append(
            f"broadcast / reshard: {times['broadcast'] / times['reshard']:.2f}x time, "
            f"{reports[0].refit_bytes['broadcast'] / reports[0].refit_bytes['reshard']:.2f}x bytes"
        )
    return "\n".join(lines)


def require_matplotlib() -> None:
    """Raise a clear error now if :func:`write_plot` could not run."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib, which is not installed: pip install -e '.[grpo]' "
            "(or pip install matplotlib)"
        ) from None


def write_plot(reports: Sequence[StepReport], path: str | Path) -> Path:
    """Two panels: mean reward per step, and refit time per step for each backend."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [r.step for r in reports]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 5), sharex=True)
    top.plot(steps, [r.reward for r in reports], marker="o", ms=3)
    top.set_ylabel("mean reward")
    top.grid(alpha=0.3)
    for b in reports[0].refit_seconds if reports else ():
        bottom.plot(steps, [r.refit_seconds[b] * 1e3 for r in reports], marker="o", ms=3, label=b)
    bottom.set_ylabel("refit time (ms)")
    bottom.set_xlabel("GRPO step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.legend()
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
