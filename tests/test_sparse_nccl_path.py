"""benchmarks/sparse_nccl_path.py: vLLM 0.33's sparse_nccl data path on CPU gloo.

Byte counts by hand from the wire format: per changed tensor one int32 indices
broadcast (4 bytes per changed element) and one values broadcast (itemsize per changed
element), to every inference rank; unchanged tensors are not sent; no headers on the
data plane. Three refits over tensors a (bf16 4x8), b (bf16 16), c (fp32 6x2):
  1: a at {0, 5, 31}, c at {1, 11}:  3 * (4 + 2) + 2 * (4 + 4) = 34 bytes a copy
  2: all of b (one 0.0 -> -0.0):    16 * (4 + 2)               = 96 bytes a copy
  3: nothing changed: send_weights is a no-op, 0 bytes, no RPC.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from benchmarks.sparse_nccl_path import (
    ShardedModel,
    payload_bytes,
    run_sparse_nccl,
    sparse_patches,
    update_info,
)
from tests.helpers import vllm_env
from tests.helpers.requires import requires

R = 2  # inference ranks
PAYLOAD = [34, 96, 0]  # one copy per refit, by hand (module docstring)
PATCHES = [2, 1, 0]
CHANGED = [5, 16, 0]


def tiny_steps() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    s0 = {
        "a": torch.randn(4, 8, generator=g).bfloat16(),
        "b": torch.randn(16, generator=g).bfloat16(),
        "c": torch.randn(6, 2, generator=g),
    }
    s0["b"][3] = 0.0
    s1 = {k: v.clone() for k, v in s0.items()}
    s1["a"].view(-1)[[0, 5, 31]] += 1.0
    s1["c"].view(-1)[[1, 11]] -= 0.5
    s2 = {k: v.clone() for k, v in s1.items()}
    s2["b"] = s2["b"] * 2 + 1  # every element changes ...
    s2["b"][3] = -0.0  # ... this one in its sign bit only (equal as a value)
    s3 = {k: v.clone() for k, v in s2.items()}
    return [s0, s1, s2, s3]


def metadata(step: int) -> int:
    """The update_weights HTTP body of refit ``step``, as vLLM's client posts it."""
    info = [
        {"names": ["a", "c"], "dtype_names": ["bfloat16", "float32"],
         "shapes": [[4, 8], [6, 2]], "num_updates_list": [3, 2]},
        {"names": ["b"], "dtype_names": ["bfloat16"], "shapes": [[16]],
         "num_updates_list": [16]},
    ]  # fmt: skip
    return len(json.dumps({"update_info": info[step - 1]})) if step <= 2 else 0


def test_patches_are_int32_flat_indices_and_new_values() -> None:
    steps = tiny_steps()
    patches = sparse_patches(steps[0], steps[1])
    assert [p.name for p in patches] == ["a", "c"]
    a, c = patches
    assert a.indices.dtype == torch.int32 and a.indices.tolist() == [0, 5, 31]
    assert torch.equal(a.values, steps[1]["a"].view(-1)[[0, 5, 31]])
    assert a.values.dtype == torch.bfloat16 and a.full_shape == (4, 8)
    assert c.indices.tolist() == [1, 11] and c.values.dtype == torch.float32
    assert payload_bytes(patches) == PAYLOAD[0]
    assert update_info(patches)["num_updates_list"] == [3, 2]
    (b,) = sparse_patches(steps[1], steps[2])
    assert b.indices.numel() == 16  # -0.0 vs 0.0 differs in bits
    assert sparse_patches(steps[2], steps[3]) == []
    empty = sparse_patches(steps[2], steps[3], include_unchanged=True)
    assert [p.indices.numel() for p in empty] == [0, 0, 0] and payload_bytes(empty) == 0


def test_sharded_model_keeps_its_tp_shard_and_notices_a_wrong_bit() -> None:
    steps = tiny_steps()
    model = ShardedModel(steps[0], tp=2, tp_rank=1)
    assert model.shards["a"].shape == (2, 8) and model.shards["c"].shape == (3, 2)
    assert torch.equal(model.shards["a"], steps[0]["a"][2:])
    assert model.equals(steps[0]) and not model.equals(steps[1])
    model.shards["a"].view(torch.int16)[0, 0] ^= 1
    assert not model.equals(steps[0])


def check(results: list, include_unchanged: bool = False) -> None:
    assert [r.step for r in results] == [1, 2, 3]
    for r, one, n, k in zip(results, PAYLOAD, PATCHES, CHANGED):
        assert r.payload_bytes == one
        assert r.bytes_sent == R * one
        assert r.busiest_rank_bytes == R * one  # star from trainer rank 0
        assert r.patches == (3 if include_unchanged else n)  # empty ones: 0 bytes
        assert r.changed == k and r.elements == 32 + 16 + 12
        assert r.bit_exact, r
    if include_unchanged:  # every refit has patches, so the RPCs all happen
        assert all(r.metadata_bytes > 0 for r in results)
    else:
        assert [r.metadata_bytes for r in results] == [metadata(s) for s in (1, 2, 3)]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_replica_exact_bytes_and_bit_exact(tp: int) -> None:
    results = run_sparse_nccl(tiny_steps(), R, inference_tp=tp, engine="replica")
    check(results)


@pytest.mark.slow
def test_replica_empty_patches_add_no_bytes() -> None:
    results = run_sparse_nccl(tiny_steps(), R, engine="replica", include_unchanged=True)
    check(results, include_unchanged=True)


_PROGRAM = """
import json, sys, torch
from dataclasses import asdict
from benchmarks.sparse_nccl_path import run_sparse_nccl
steps = torch.load(sys.argv[1])
results = run_sparse_nccl(steps, 2, inference_tp=int(sys.argv[2]), engine="vllm")
print("RESULT " + json.dumps([asdict(r) for r in results]))
"""


@pytest.mark.slow
@requires(vllm_env.skip_reason)
def test_vllm_engine_classes_send_the_same_bytes(tmp_path) -> None:
    """vLLM's own SparseNCCL{Trainer,}WeightTransferEngine over the gloo shim."""
    from benchmarks.sparse_nccl_path import StepResult

    path = tmp_path / "steps.pt"
    torch.save(tiny_steps(), path)
    done = subprocess.run(
        [vllm_env.vllm_python(), "-c", _PROGRAM, str(path), "2"],
        cwd=vllm_env.REPO, env=vllm_env.vllm_env(), capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    check([StepResult(**r) for r in json.loads(lines[-1][len("RESULT ") :])])
