"""A colocated host's own work per refit step, in one process: ``ColocatedHost.replay``
with the network and the worker stood in by no-ops, so what is timed is the host's packing
(and, before issue 40 item 10, its copy of its own worker's bytes from its send buffer into
the staging) — none of the scheduling noise of a multi-process run.

    PYTHONPATH=<tree> python3 benchmarks/colocated_host_work.py [--repeats N]

The configuration is ``nemo-refit-reshard demo --colocated``'s (small-qwen3, Megatron
tp=2,pp=2 -> vLLM tp=2,dp=2, bucket 512 MiB), training rank 0. Prints the median
milliseconds per step and the bytes of the staging the host writes through its pack.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nemo_refit_reshard.engine.colocated import ColocatedHost
from nemo_refit_reshard.engine.materialize import SyntheticWeights, materialize
from nemo_refit_reshard.plan import rank_plan
from nemo_refit_reshard.runner import RunConfig, build_layouts
from nemo_refit_reshard.runner.colocated import colocated_plan


class _Nothing:
    """The network (nothing crosses it in this timing) and the worker (it answers at once)."""

    def begin_step(self, *args) -> int:
        return 0

    def fail_step(self, *args) -> None:
        pass

    def exchange(self, *args) -> None:
        pass

    def send(self, *args) -> None:
        pass

    def wait(self, *args) -> None:
        pass

    def abort(self, *args) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = RunConfig()
    plan = colocated_plan(cfg)
    spec, sources, _ = build_layouts(cfg)
    tensors = materialize(sources[0], SyntheticWeights(spec.unquantized(), cfg.seed))
    s = plan.num_sources
    guest = plan.colocated_hosts.index(0) + s
    host = ColocatedHost(rank_plan(plan, 0), rank_plan(plan, guest), 0, tensors)
    host.signals = _Nothing()  # type: ignore[assignment]
    nothing = _Nothing()
    times = []
    for _ in range(args.repeats + 1):  # the first: warm-up
        t0 = time.perf_counter()
        host.replay(nothing)  # type: ignore[arg-type]
        times.append(time.perf_counter() - t0)
    local = sum(n for msgs in plan.traffic() for src, dst, n in msgs if (src, dst) == (0, guest))
    print(
        f"host work per step: {statistics.median(times[1:]) * 1e3:.1f} ms (median of "
        f"{args.repeats}); its own worker's bytes {local / 2**20:.1f} MiB"
    )
    close = getattr(host, "close", None)  # releases the staging where the tree has it
    if close is not None:
        close()
    elif host.staging is not None:
        host.staging.close()


if __name__ == "__main__":
    main()
