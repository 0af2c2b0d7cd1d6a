"""benchmarks/delta_density_grpo.py: the bit counting, and two real GRPO steps of the app.

* ``bits_changed`` on a hand-made pair: BF16 and FP32 bit changes, exact counts (a sign
  flip of zero counts, an FP32 step below half a BF16 ulp does not in BF16, equal NaN
  bits do not);
* two steps of the CPU GRPO app (Ray, tp=2 trainers, delta refit) at a large lr: every
  step changes some attention and MLP elements in BF16, fractions lie in [0, 1], and the
  delta refit's bytes come from the app's step report.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import delta_density_grpo as ddg  # noqa: E402


def test_bits_changed_counts_exactly() -> None:
    one = 1.0
    before = torch.tensor([one, one, one, -0.0, float("nan"), 0.02, 3.0], dtype=torch.float32)
    after = torch.tensor(
        [
            one + 2**-10,  # FP32 changes; BF16 (7 mantissa bits) rounds it back to 1.0
            one + 2**-7,  # one BF16 ulp: both change
            one,  # unchanged
            0.0,  # equal as floats, sign bit differs: both change
            float("nan"),  # same NaN bits: no change although nan != nan
            0.02 + 1e-6,  # below half a BF16 ulp of 0.02 (~6e-5): FP32 only
            -3.0,  # sign: both change
        ],
        dtype=torch.float32,
    )
    assert ddg.bits_changed(before, after, torch.bfloat16) == 3
    assert ddg.bits_changed(before, after, torch.float32) == 5
    assert ddg.bits_changed(before, before.clone(), torch.bfloat16) == 0
    with pytest.raises(ValueError, match="shapes differ"):
        ddg.bits_changed(before, after[:3], torch.bfloat16)


@pytest.mark.slow
def test_two_grpo_steps_change_attention_and_mlp() -> None:
    pytest.importorskip("ray")
    # The 74K-parameter toy policy, one generation replica: the run is mostly start-up.
    small = ["model.hidden_size=64", "model.intermediate_size=128", "infer.tp=1", "infer.dp=1"]
    small += ["grpo.prompts_per_step=4", "grpo.group_size=4", "refit.timeout_s=30"]
    result = ddg.main(["--lr", "1e-3", "--steps", "2", "--set", *small])
    (run,) = result["runs"]
    assert [s["step"] for s in run["steps"]] == [1, 2]
    assert {t["cls"] for t in run["tensors"].values()} >= {"attention", "mlp", "norms"}
    for s in run["steps"]:
        f = s["fraction"]
        assert all(0.0 <= v <= 1.0 for v in f.values()), f
        assert f["attention"] > 0 and f["mlp"] > 0, f
        # overall = changed / elements over every tensor, each element counted once
        total = sum(t["numel"] for t in run["tensors"].values())
        assert f["overall"] == pytest.approx(sum(s["changed"].values()) / total)
        assert 0 < s["delta_sent_bytes"] and 0 < s["delta_dense_bytes"]
    assert "| lr |" in ddg.markdown(result)
