"""A bad value in a config prints one line — key, value, choices — and exits with status
2, no traceback (Hydra's handler included): the GRPO example as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_refit_reshard.grpo_cpu.report import require_matplotlib

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_cpu.py"


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, line",
    [
        ("refit.backend=bogus", "error: unknown refit.backend 'bogus'; choose one of: reshard, "
         "broadcast"),
        ("refit.nope=1", "error: refit.nope=1: refit has no key 'nope'; choose one of: backend, "
         "bucket_mb, compare_broadcast, delta, delta_anchor_every, timeout_s, verify"),
        ("train.tp=3", "error: train (tp=3,pp=1,vpp=1,cp=1,dp=1,ep=1,etp=3): tp=3 must divide "
         "num_attention_heads=4 (Megatron's rule)"),
        ("infer.tp=3", "error: infer (tp=3,pp=1,dp=2,engine_dp=1,ep=1): tp=3 must divide "
         "num_attention_heads=4 (vLLM's rule)"),
        ("model.policy=gpt5", "error: unknown model.policy 'gpt5'; choose one of ('toy-qwen3',)"),
        ("grpo.lr=abc", "error: grpo.lr='abc' must be a number"),
        ("refit=[", "error: no viable alternative at input '['"),
    ],
)  # fmt: skip
def test_one_line_and_status_2(override: str, line: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLE.parents[1]), *sys.path])}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), override], capture_output=True, text=True, env=env
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [line]
    assert done.stdout == ""


def test_plot_without_matplotlib_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(ValueError) as err:
        require_matplotlib()
    assert str(err.value) == (
        "--plot needs matplotlib, which is not installed: pip install -e '.[grpo]' "
        "(or pip install matplotlib)"
    )
