"""``demo --delta``: real processes over gloo, Adam steps between refits, every delta
step checked bit-exact on every inference rank; and its argument errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_refit_reshard.cli import main
from tests.helpers.model_configs import MODELS


@pytest.fixture
def qwen3_config(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MODELS["qwen3"]))
    return str(path)


@pytest.mark.slow
def test_demo_delta_separate_pools_and_colocated(qwen3_config: str, capsys) -> None:
    argv = [
        "demo",
        "--delta",
        "--model",
        qwen3_config,
        "--train",
        "tp=2,dp=2",
        "--infer",
        "tp=2,dp=2",
    ]
    assert main([*argv, "--steps", "5", "--lr", "1e-5", "--colocated", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["backends"]) == ["reshard", "delta", "reshard-colocated"]
    assert report["config"]["delta"] is True and report["config"]["lr"] == 1e-5
    for name in ("delta", "reshard-colocated"):
        steps = report["backends"][name]["delta_steps"]
        assert [s["exact"] for s in steps] == [True] * 5  # five Adam steps, every one checked
        assert all(0 < s["changed"] < 1 for s in steps)
        assert all(s["sent_bytes"] < s["dense_bytes"] for s in steps)
        assert report["backends"][name]["verified"] is True
    delta = report["backends"]["delta"]
    assert delta["bytes"] == sorted(s["sent_bytes"] for s in delta["delta_steps"])[2]


@pytest.mark.parametrize(
    "extra, error",
    [
        (["--backends", "reshard,delta"], "the delta backend goes with --delta"),
        (["--delta", "--backends", "reshard"], "the delta backend goes with --delta"),
        (["--delta", "--lr", "0"], "--lr 0.0 must be > 0"),
    ],
)
def test_delta_arguments_are_checked(extra: list[str], error: str, capsys) -> None:
    assert main(["demo", *extra]) == 2
    assert error in capsys.readouterr().err
