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

import hydra
from omegaconf import DictConfig, OmegaConf

from nemo_refit_reshard.integrations.grpo.config import GrpoRunConfig
from nemo_refit_reshard.integrations.grpo.driver import run_grpo
from nemo_refit_reshard.integrations.grpo.report import (
    pop_plot_flag,
    require_matplotlib,
    summary,
    write_plot,
)

PLOT = pop_plot_flag(sys.argv)  # before Hydra parses sys.argv


@hydra.main(config_path="../configs", config_name="grpo_cpu", version_base=None)
def main(cfg: DictConfig) -> None:
    run_cfg = GrpoRunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
    if PLOT is not None:
        require_matplotlib()  # fail now, not after the run
    t0 = time.perf_counter()
    reports = run_grpo(run_cfg)
    print(summary(reports, run_cfg.refit.backend, time.perf_counter() - t0))
    if PLOT is not None:
        print(f"plot: {write_plot(reports, PLOT)}")


if __name__ == "__main__":
    main()
