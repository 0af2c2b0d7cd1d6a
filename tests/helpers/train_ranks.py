"""Start the Megatron training ranks of a vLLM refit test (``tests/programs/
train_refit_rank.py``), one process each under the vLLM venv's interpreter."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from nemo_refit_reshard.integrations.worker import RefitEndpoint
from nemo_refit_reshard.spec import TrainParallel
from tests.helpers import vllm_env


def start_training_ranks(
    cfg: dict[str, Any],
    train: TrainParallel,
    endpoint: RefitEndpoint,
    plan: Any,
    checkpoints: list[str],
    work: Path,
) -> list[subprocess.Popen]:
    """Refit ranks ``0 .. train.world_size - 1``: each loads ``cfg`` into a real
    megatron-core model and sends the plan's pieces of every checkpoint in turn."""
    procs = []
    for r in range(train.world_size):
        path = work / f"train{r}.json"
        path.write_text(
            json.dumps(
                dict(
                    config=cfg,
                    train=str(train),
                    rank=r,
                    endpoint=dataclasses.replace(endpoint, group_rank=r).to_json(),
                    plan=plan,
                    checkpoints=checkpoints,
                    init_file=str(work / "megatron.init"),
                )
            )
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, *vllm_env.program("train_refit_rank"), str(path)],
                env=vllm_env.vllm_env(),
                cwd=vllm_env.REPO,
            )
        )
    return procs
