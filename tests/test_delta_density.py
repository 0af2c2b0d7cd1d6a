"""benchmarks/delta_density.py end to end: a real megatron-core GPTModel, Megatron's own
BF16 optimizer, two steps at lr 1e-3 and at lr 0 (in a subprocess: the script patches
``torch.cuda`` globally). The script itself checks every step against the AdamW formula
and that each BF16 parameter is the cast of its FP32 master."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# A small model and byte tokens keep the run short; the script's code path is the same.
SMALL = ["--layers", "2", "--tokenizer", "byte", "--corpus-chars", "50000"]
SMALL += ["--batch", "2", "--seq", "32", "--steps", "2"]


def run_script(*extra: str) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "delta_density.py"), *SMALL, *extra]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


def test_large_lr_changes_most_weights_and_zero_lr_none() -> None:
    result = run_script("--lr", "1e-3", "0", "--json", "-")
    big, zero = result["runs"]
    assert (big["lr"], zero["lr"]) == (1e-3, 0.0)
    assert [s["step"] for s in big["steps"]] == [1, 2]
    classes = {t["cls"] for t in big["tensors"].values()}
    assert classes == {"attention", "mlp", "embeddings", "norms"}
    total = sum(t["numel"] for t in big["tensors"].values())
    assert {t["dtype"] for t in big["tensors"].values()} == {"bfloat16"}
    for s in big["steps"]:
        assert s["fraction"]["overall"] > 0.5
        assert s["fraction"]["attention"] > 0.5 and s["fraction"]["mlp"] > 0.5
        # Every counted change is one element of one tensor.
        assert sum(s["changed"].values()) == round(s["fraction"]["overall"] * total)
    # Norm weights start at exactly 1.0; one Adam step moves a master by at most about lr
    # (|m̂/sqrt(v̂)| = 1 at t = 1) and norms get no weight decay, while the nearest BF16
    # values to 1.0 are 1 - 2^-8 and 1 + 2^-7: after step 1 no norm weight has changed.
    assert big["steps"][0]["fraction"]["norms"] == 0.0
    for s in zero["steps"]:
        assert s["master_changed"] == 0
        assert set(s["changed"].values()) == {0}
        assert all(f == 0.0 for f in s["fraction"].values())
    # Same seed, same initial weights, same first batch: the first losses are identical.
    assert big["steps"][0]["loss"] == zero["steps"][0]["loss"]
