"""End-to-end GRPO on CPU: Megatron training actors refit vLLM-layout generators on Ray.

    python examples/grpo_cpu.py
    python examples/grpo_cpu.py refit.backend=broadcast train.tp=2 infer.tp=2 infer.dp=2
    python examples/grpo_cpu.py --plot            # also write grpo_cpu.png
    python examples/grpo_cpu.py --plot docs/grpo_cpu.png grpo.num_steps=30

Settings: configs/grpo_cpu.yaml (Hydra overrides as above). Per step it prints the mean
reward, refit time and bytes per backend, the largest |generator - trainer| log-prob
of the sampled tokens and the step's wall time; at the end a summary.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from nemo_refit_reshard.grpo_cpu.config import GrpoRunConfig
from nemo_refit_reshard.grpo_cpu.driver import run_grpo
from nemo_refit_reshard.grpo_cpu.report import (
    pop_plot_flag,
    require_matplotlib,
    summary,
    write_plot,
)
from nemo_refit_reshard.integrations.hydra_config import configure_or_exit, load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def main(argv: list[str]) -> int:
    plot = pop_plot_flag(argv)

    def configure() -> GrpoRunConfig:
        # A bad key or value: one line naming key, value and choices, exit status 2.
        run_cfg = GrpoRunConfig.from_dict(load_config(CONFIGS, "grpo_cpu", argv))
        if plot is not None:
            require_matplotlib()  # fail now, not after the run
        return run_cfg

    run_cfg = configure_or_exit(configure)
    t0 = time.perf_counter()
    reports = run_grpo(run_cfg)
    print(summary(reports, run_cfg.refit.backend, time.perf_counter() - t0))
    if plot is not None:
        print(f"plot: {write_plot(reports, plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
