"""benchmarks/colocated_bytes.py on a small MoE: every figure against an independent count.

small-qwen3-moe, Megatron tp=2, ep=2, dp=2 (etp=2) -> vLLM tp=2, dp=2, four GPUs. The
independent counts come from the model spec by name (which tensors Megatron replicates,
which it shards over TP, which are experts), not from the layouts the figures read.
"""

from __future__ import annotations

import math

import pytest

from benchmarks.colocated.common import build_case, loaded_bytes, param_bytes, vllm_modules
from benchmarks.colocated.export import export
from benchmarks.colocated.nemo_rl import nemo_rl_figures
from benchmarks.colocated.ours import gpu_shares, ours_figures
from benchmarks.colocated.vllm_ipc import chunks, vllm_ipc_figures, worker_peak_packed
from benchmarks.colocated_bytes import main

BF16 = 2


@pytest.fixture(scope="module")
def case():
    return build_case("small-qwen3-moe", "tp=2,ep=2,dp=2", "tp=2,dp=2")


def _replicated(name: str) -> bool:
    """Megatron keeps norms and the router whole on every rank."""
    return name.endswith("norm.weight") or name.endswith("mlp.gate.weight")


def _bytes(case, pick) -> int:
    return sum(t.numel * BF16 for t in case.spec if pick(t.name))


def test_ours_splits_the_floor_into_interconnect_and_local(case):
    shares = gpu_shares(case)
    split = case.plan.colocated_bytes()
    assert split.network + split.local == case.plan.stats.min_bytes
    assert sum(g["net_in"] for g in shares) == split.network
    assert sum(g["local"] for g in shares) == split.local > 0
    bucket = int(case.cfg.bucket_mb * 2**20)
    for g, share in enumerate(shares):
        assert share["unpack"] == loaded_bytes(case.destinations[g])  # each element once
        assert share["move"] == 0 < share["local"]  # its own bytes: packed into the staging
        assert share["send_buffer"] <= bucket and share["staging"] <= bucket
    f = ours_figures(case)
    assert (f.net_total, f.materialized_max) == (split.network, 0)
    assert f.copied_max == max(g["pack"] + g["move"] + g["unpack"] for g in shares)


def test_export_yields_every_tensor_once_and_gathers_what_the_spec_says(case):
    a = case.spec.arch
    model = _bytes(case, lambda n: True)
    experts = _bytes(case, lambda n: ".experts." in n)
    embeddings = ("model.embed_tokens.weight", "lm_head.weight")
    dense = _bytes(
        case, lambda n: not _replicated(n) and ".experts." not in n and n not in embeddings
    )
    padded_vocab = math.ceil(a.vocab_size / (128 * 2)) * 128 * 2  # Megatron pads for tp=2
    for rank in range(case.num_gpus):
        e = export(case, rank)
        names = [n for n, _ in e.stream]
        assert sorted(names) == sorted(t.name for t in case.spec)
        assert sum(b for _, b in e.stream) == model
        # what the TP/EP gathers produce: everything but the replicated tensors
        assert e.materialized == _bytes(case, lambda n: not _replicated(n))
        # TP all-gather: the other half of every sharded tensor (the vocabulary padded);
        # experts: half of each local expert (etp=2), then the other EP rank's experts
        vocab = 2 * padded_vocab * a.hidden_size * BF16
        assert e.received == dense // 2 + vocab // 2 + 3 * experts // 4


def test_nemo_rl_streams_the_whole_model_on_every_gpu(case):
    f = nemo_rl_figures(case)
    e = export(case, 0)
    assert f.net_total == case.num_gpus * e.received  # every rank gathers the same
    assert f.materialized_max == e.materialized
    model = _bytes(case, lambda n: True)
    # the export's copies + packing every tensor + the worker keeping its shard
    assert f.copied_max == e.copies + model + max(map(loaded_bytes, case.destinations))
    assert f.extra_max == e.peak_transient and f.extra_runtime


def test_vllm_ipc_packed_chunks_and_worker_peak(case):
    e = export(case, 0)
    model = sum(b for _, b in e.stream)
    largest = max(b for _, b in e.stream)
    parts = chunks(e.stream, 4 * largest)
    assert [x for part in parts for x in part] == e.stream
    assert all(sum(b for _, b in part) <= 4 * largest for part in parts)
    with pytest.raises(ValueError):
        chunks(e.stream, largest - 1)
    dst = case.destinations[0]
    # one chunk: every clone alive, plus the largest layer when it is materialized
    assert worker_peak_packed(e.stream, model, dst) == model + max(vllm_modules(dst)[2].values())
    unpacked = vllm_ipc_figures(case, packed=False)
    packed = vllm_ipc_figures(case, packed=True)
    worker = loaded_bytes(dst) + param_bytes(dst)
    assert unpacked.copied_max == e.copies + worker
    assert packed.copied_max == e.copies + 2 * model + worker
    assert unpacked.extra_max >= e.held_new >= e.materialized


def test_table_prints(capsys, monkeypatch):
    import benchmarks.colocated_bytes as script

    monkeypatch.setattr(script, "CASES", [("small-qwen3-moe", "tp=2,ep=2,dp=2", "tp=2,dp=2")])
    main([])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert len(rows) == 2 + len(script.SYSTEMS)
    assert "needs a GPU" in rows[3]  # NeMo RL's buffer is a fraction of free memory
