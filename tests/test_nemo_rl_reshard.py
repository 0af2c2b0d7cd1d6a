"""``refit.backend: reshard`` through NeMo RL's real GRPO refit, worker and config classes.

``tests/nemo_rl_reshard_driver.py`` runs under the Python of ``scripts/setup_nemo_rl_cpu.sh``
built on Python >= 3.12 (``nemo_rl.algorithms.grpo`` refuses older Pythons): NeMo RL's
``refit_policy_generation`` calls our ``ReshardWeightSynchronizer``, which plans from the
NeMo RL config and the workers' reports, and moves the local shards of real Megatron-core
models (held by our subclass of NeMo RL's ``MegatronPolicyWorkerImpl``) into vLLM 0.25.1's
own model classes through NeMo RL's vLLM RPC mixin. The overlays go through NeMo RL's
config loader, Hydra override parser and ``MasterConfig``. CI has no NeMo RL source, so
these skip there, saying how to install it; docs/nemo_rl.md says where they ran.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from nemo_refit_reshard.spec import spec_from_hf_config
from tests.helpers import broken_rules, vllm_env
from tests.helpers.checkpoints import fp8_checkpoints, write_steps
from tests.helpers.model_configs import MODELS
from tests.helpers.requires import requires

# The quantization_config NeMo RL's init_fp8 passes vLLM (no BF16 layers).
NEMO_RL_FP8 = {
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
}

pytestmark = [pytest.mark.slow, requires(vllm_env.nemo_rl_grpo_skip_reason)]


TP2 = dict(train="tp=2", megatron_cfg={"tensor_model_parallel_size": 2}, vllm_tp=2, vllm_pp=1)
# Megatron PP and vLLM PP > 1 (which NeMo RL's nccl_reshard refuses).
PP2 = dict(train="pp=2", megatron_cfg={"pipeline_model_parallel_size": 2}, vllm_tp=1, vllm_pp=2)
FOUR_LAYERS = {"num_hidden_layers": 4, "layer_types": ["full_attention"] * 4}  # pp=2 splits it


# Colocated: Megatron tp=2,pp=2 and two vLLM engines of tp=2 on the same 4 GPUs; vLLM rank
# d on the GPU of policy rank 3-d (placement from the reported GPUs, not rank order).
COLOCATED = dict(
    train="tp=2,pp=2",
    megatron_cfg={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    vllm_tp=2,
    vllm_pp=1,
    gpus={"policy": ["gpu0", "gpu1", "gpu2", "gpu3"], "vllm": ["gpu3", "gpu2", "gpu1", "gpu0"]},
)


def drive(
    tmp: Path,
    scenario: str,
    steps: int,
    sizes: dict = TP2,
    fp8: bool = False,
    async_grpo: dict | None = None,
    **refit: Any,
) -> dict:
    """``fp8``: NeMo RL's ``vllm_cfg.precision: fp8`` on a BF16-trained model whose
    shards are whole 128x128 blocks; vLLM loads and is compared with the checkpoints
    quantized by the one quantizer (``fp8_checkpoints``)."""
    cfg = dict(MODELS["qwen3"], **(FOUR_LAYERS if "pp=2" in sizes["train"] else {}))
    if fp8:
        cfg = {k: v for k, v in MODELS["qwen3_fp8"].items() if k != "quantization_config"}
        cfg["torch_dtype"] = "bfloat16"
    (tmp / "config.json").write_text(json.dumps(cfg))
    # step 0: what vLLM loads at start-up
    checkpoints = write_steps(spec_from_hf_config(cfg), tmp, range(steps + 1), seed=700)
    extra: dict[str, Any] = {}
    if fp8:
        quantized = spec_from_hf_config({**cfg, **NEMO_RL_FP8})
        extra = dict(fp8=True, fp8_checkpoints=fp8_checkpoints(quantized, checkpoints))
    if async_grpo is not None:
        extra["async_grpo"] = async_grpo
    spec = dict(
        **extra,
        config=cfg,
        model_dir=str(tmp),
        engines=2,
        **sizes,
        checkpoints=checkpoints,
        scenario=scenario,
        refit={
            "backend": "reshard",
            "transport": "gloo",
            "host": "127.0.0.1",  # the refit group's rendezvous stays on loopback
            "timeout_s": 120,
            **refit,
        },
    )
    spec_path, result = tmp / "spec.json", tmp / "result.json"
    spec_path.write_text(json.dumps(spec))
    python = vllm_env.nemo_rl_grpo_python()
    proc = vllm_env.start("nemo_rl_reshard_driver", str(spec_path), str(result), python=python)
    vllm_env.finish(proc, "NeMo RL reshard driver")
    out = json.loads(result.read_text())
    assert "error" not in out, out.get("traceback")
    return out


def test_fp8_generation_refit_is_bit_exact(tmp_path: Path) -> None:
    """``vllm_cfg.precision: fp8``: vLLM 0.25.1's engine built with the quantization NeMo
    RL's own ``init_fp8`` returns, refit from BF16 Megatron tp=2 with e4m3 + scales on the
    wire (the plan says so): after each of two steps every vLLM parameter equals vLLM's
    own load of that step's checkpoint quantized by the one quantizer."""
    out = drive(tmp_path, "refit", steps=2, fp8=True)
    assert "init_error" not in out, out["init_error"]
    assert "MiB float8_e4m3fn" in out["plan"] and "MiB float32" in out["plan"], out["plan"]
    for step in out["steps"]:
        assert "error" not in step, step["error"]
        assert step["differ"] == [[]] * 4, step
    assert out["closed"] is True


@pytest.mark.parametrize("sizes", [TP2, PP2], ids=["tp2", "pp2"])
def test_grpo_refit_moves_local_shards_bit_exact(tmp_path: Path, sizes: dict) -> None:
    """2 Megatron ranks (tp=2; pp=2) -> 2 vLLM engines (tp=2; pp=2), two refits of new weights:
    every vLLM parameter equals vLLM's own load of that step's checkpoint; stale until
    the first sync. The policy worker is our subclass of NeMo RL's Megatron worker where
    Megatron-Bridge imports, else (on CPU) the mixin that subclass adds, on its own."""
    out = drive(tmp_path, "refit", steps=2, sizes=sizes)
    worker = out["policy_worker"]
    mro = worker["mro"]
    assert "nemo_refit_reshard.integrations.nemo_rl.policy_worker.ReshardPolicyWorkerMixin" in mro
    if worker["import_error"] is None:  # Megatron-Bridge importable: NeMo RL's own worker
        assert mro[0] == (
            "nemo_refit_reshard.integrations.nemo_rl.megatron_worker."
            "ReshardMegatronPolicyWorkerImpl"
        )
        base = "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorkerImpl"
        assert base in mro
    else:  # on CPU: every Megatron-Bridge release imports Transformer Engine at load
        assert (
            "megatron.bridge" in worker["import_error"]
            or "transformer_engine" in (worker["import_error"])
        )
    assert out["plan"].startswith("reshard plan ")
    want = {
        "tp=2": "Megatron tp=2,pp=1,vpp=1,cp=1,dp=1,ep=1,etp=2 -> vLLM tp=2,pp=1,dp=2,",
        "pp=2": "Megatron tp=1,pp=2,vpp=1,cp=1,dp=1,ep=1,etp=1 -> vLLM tp=1,pp=2,dp=2,",
    }[sizes["train"]]
    assert want in out["plan"], out["plan"]
    first, second = out["steps"]
    assert (first["stale_before"], first["stale_after"]) == (True, False)
    assert (second["stale_before"], second["stale_after"]) == (False, False)
    for step in out["steps"]:
        assert step["differ"] == [[]] * 4, step
        assert step["metrics"]["reshard/bytes"] > 0
    assert out["closed"] is True


@pytest.mark.parametrize("in_flight", [False, True], ids=["drained", "in_flight"])
def test_async_grpo_refits_through_nemo_rl_trajectory_collector(
    tmp_path: Path, in_flight: bool
) -> None:
    """``grpo.async_grpo.enabled`` with ``vllm_cfg.async_engine``: each refit is
    ``async_grpo_train``'s, around NeMo RL's own ``AsyncTrajectoryCollector`` (new
    generations paused, pending ones drained unless ``in_flight_weight_updates``), the
    calls into vLLM through NeMo RL's async RPC mixin. Bit-exact after each step, the
    weight version advanced by one per refit, stale until the first sync."""
    out = drive(tmp_path, "refit", steps=2, async_grpo={"in_flight_weight_updates": in_flight})
    first, second = out["steps"]
    assert (first["stale_before"], first["stale_after"]) == (True, False)
    assert (second["stale_before"], second["stale_after"]) == (False, False)
    assert [s["weight_version"] for s in out["steps"]] == [[0, 1], [1, 2]]
    for step in out["steps"]:
        assert step["differ"] == [[]] * 4, step
        assert step["metrics"]["reshard/bytes"] > 0
    assert out["closed"] is True


def test_broken_megatron_rule_fails_the_refit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: the Megatron policy workers hold Megatron's own placement of the
    weights (its sharded state dict, never our layout), so with k and v swapped in our
    Megatron rule (in every process: ``NRR_BROKEN_MEGATRON_RULE``) the refit above sends
    the wrong rows and every vLLM worker sees exactly its fused qkv_proj differ."""
    monkeypatch.setenv(broken_rules.ENV, "kv")
    out = drive(tmp_path, "refit", steps=1)
    qkv = [f"model.layers.{i}.self_attn.qkv_proj.weight" for i in range(3)]
    assert out["steps"][0]["differ"] == [qkv] * 4, out["steps"]


def test_wrong_config_is_named_before_any_transfer(tmp_path: Path) -> None:
    """The NeMo RL config says tp=1 while the Megatron workers run tp=2."""
    claims_tp1 = dict(TP2, megatron_cfg={"tensor_model_parallel_size": 1})
    out = drive(tmp_path, "refit", steps=1, sizes=claims_tp1)
    error = out["init_error"]
    assert error.startswith(
        "PlanError: Megatron policy workers do not match the planned layout "
        "tp=1,pp=1,vpp=1,cp=1,dp=2,ep=1,etp=1"
    ), error
    assert "rank 1: tp=1 (planned 0), dp=0 (planned 1)" in error
    assert "tp_size=2 (config 1)" in error
    assert "steps" not in out


def test_dead_vllm_worker_is_named_and_leaves_weights_stale(tmp_path: Path) -> None:
    """A vLLM worker killed before the second refit: the refit raises, naming its
    engine; every other worker gives up within the refit timeout; stale again."""
    out = drive(tmp_path, "dead_worker", steps=2, timeout_s=60)
    first, second = out["steps"]
    assert first["differ"] == [[]] * 4 and first["stale_after"] is False
    error = second["error"]
    assert error.startswith("RuntimeError: refit step 2 failed on "), error
    assert "vLLM engine 1: " in error, error
    assert "ActorDiedError" in error or "RayActorError" in error, error
    assert second["stale_after"] is True
    # The surviving engine's workers: each either received all of step 2 (its senders
    # were alive) or knows its weights may be torn — never fresh with a partial step.
    for status in out["surviving_status"]:
        complete = status["step"] == 2 and status["stale"] is None
        torn = status["step"] == 1 and status["stale"].startswith(
            "the refit of step 2 failed (TransportError: refit rank "
        )
        assert complete or torn, status


def test_overlays_through_nemo_rl_config(tmp_path: Path) -> None:
    """configs/nemo_rl's reshard overlays with NeMo RL's own defaults, through its loader,
    Hydra override parser and ``MasterConfig``: our refit block passes through
    ``MasterConfig`` untouched and selects the backend; an unknown backend is refused."""
    configs = vllm_env.REPO / "configs" / "nemo_rl"
    example = vllm_env.REPO / "examples" / "nemo_rl" / "run_grpo.py"
    probe = f"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("run_grpo", {str(example)!r})
run_grpo = importlib.util.module_from_spec(spec); spec.loader.exec_module(run_grpo)
from nemo_rl.algorithms.grpo import MasterConfig
from nemo_refit_reshard.integrations.nemo_rl.grpo import check_reshard_config, refit_config
from nemo_refit_reshard.integrations.nemo_rl.config import infer_parallel, train_parallel
out = {{}}
for name, overrides in [
    ("grpo_math_qwen3_8B_megatron_reshard.yaml", []),
    ("grpo_math_qwen3_8B_megatron_reshard.yaml", ["refit.backend=nccl_reshard"]),
    ("grpo_math_qwen30ba3b_megatron_reshard.yaml", ["refit.transport=gloo"]),
    ("grpo_math_qwen3_8B_megatron_reshard_colocated.yaml", []),
    ("grpo_math_qwen30ba3b_megatron_reshard_colocated.yaml", []),
]:
    raw = run_grpo.load({str(configs)!r} + "/" + name, overrides, None)
    colocated = raw["policy"]["generation"]["colocated"]["enabled"]
    res = raw["policy"]["generation"]["colocated"].get("resources") or {{}}
    total = raw["cluster"]["num_nodes"] * raw["cluster"]["gpus_per_node"]
    # NeMo RL: colocated, both sides on every GPU; else vLLM on its own resources
    gpus = total if colocated else total - res["num_nodes"] * res["gpus_per_node"]
    refit = refit_config(raw)
    if refit.backend == "reshard":
        check_reshard_config(raw)
    master = MasterConfig(**raw)
    out[name + " " + " ".join(overrides)] = dict(
        refit=master.refit,
        model=master.policy["model_name"],
        megatron=[master.policy["megatron_cfg"].get(k) for k in (
            "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "expert_model_parallel_size")],
        vllm=[master.policy["generation"]["vllm_cfg"][k] for k in (
            "tensor_parallel_size", "expert_parallel_size")],
        transport=master.policy["generation"]["refit_transport"],
        colocated=master.policy["generation"]["colocated"]["enabled"],
        gpus=[master.cluster["num_nodes"], master.cluster["gpus_per_node"]],
        sizes=None if refit.backend != "reshard" else [str(p) for p in (
            train_parallel(master.policy, gpus),
            infer_parallel(master.policy["generation"], gpus),
        )],
    )
print(json.dumps(out))
"""
    python = vllm_env.nemo_rl_grpo_python()
    assert python is not None
    got = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr[-3000:]
    out = json.loads(got.stdout.strip().splitlines()[-1])
    dense = out["grpo_math_qwen3_8B_megatron_reshard.yaml "]
    assert dense["refit"] == {
        "backend": "reshard",
        "transport": "cupy-nccl",
        "timeout_s": 600,
        "bucket_mb": 512,
        "make_vocab_size_divisible_by": 128,
        "delta": False,  # refit.delta=true: tests/test_delta_nemo_rl.py
        "delta_anchor_every": 0,
        "delta_baseline": "auto",
    }
    assert (dense["model"], dense["megatron"], dense["vllm"], dense["transport"]) == (
        "Qwen/Qwen3-8B",
        [2, 2, 1],
        [2, 1],
        None,
    )
    assert (dense["colocated"], dense["gpus"]) == (False, [2, 8])
    dense_co = out["grpo_math_qwen3_8B_megatron_reshard_colocated.yaml "]
    assert (dense_co["refit"]["backend"], dense_co["model"], dense_co["colocated"]) == (
        "reshard",
        "Qwen/Qwen3-8B",
        True,
    )
    assert dense_co["gpus"] == [1, 8]
    assert dense_co["sizes"] == [
        "tp=2,pp=2,vpp=1,cp=1,dp=2,ep=1,etp=1",  # NeMo RL's default etp=1
        "tp=4,pp=1,dp=2,engine_dp=1,ep=1",
    ]
    moe_co = out["grpo_math_qwen30ba3b_megatron_reshard_colocated.yaml "]
    assert (moe_co["model"], moe_co["colocated"], moe_co["gpus"]) == (
        "Qwen/Qwen3-30B-A3B",
        True,
        [2, 8],
    )
    assert moe_co["sizes"] == [
        "tp=2,pp=1,vpp=1,cp=1,dp=8,ep=8,etp=1",
        "tp=4,pp=1,dp=2,engine_dp=2,ep=8",
    ]
    ours = out["grpo_math_qwen3_8B_megatron_reshard.yaml refit.backend=nccl_reshard"]
    assert (ours["refit"]["backend"], ours["transport"]) == ("nccl_reshard", "nccl_reshard")
    moe = out["grpo_math_qwen30ba3b_megatron_reshard.yaml refit.transport=gloo"]
    assert moe["model"] == "Qwen/Qwen3-30B-A3B"
    assert (moe["megatron"], moe["vllm"], moe["refit"]["transport"]) == ([2, 1, 8], [4, 8], "gloo")

    bad = subprocess.run(
        [
            python,
            str(example),
            "--config",
            str(configs / "grpo_math_qwen3_8B_megatron_reshard.yaml"),
            "refit.backend=bogus",
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert bad.stderr.strip().splitlines()[-1] == (
        "error: refit.backend='bogus' is not one of reshard, nccl, nccl_reshard"
    )
    assert "Traceback" not in bad.stderr


def test_colocated_refit_through_nemo_rl_lifecycle(tmp_path: Path) -> None:
    """``policy.generation.colocated.enabled: true``: NeMo RL's colocated GRPO loop
    (vLLM sleeps after generating, the policy comes back for training) around GRPO's
    ``refit_policy_generation(colocated_inference=True)``, with NeMo RL's own ``Policy``
    and ``VllmGeneration`` offload / wake / sleep methods. Two refits of weights that
    Megatron's own sharded state dict placed: every vLLM parameter equals vLLM's own load
    of that step's checkpoint. The synchronizer woke vLLM's weights before the transfer
    (the sleep stand-in restores pre-sleep weights at wake: a transfer before it would be
    overwritten) and left the policy offloaded after it, as NeMo RL's IPC refit does."""
    out = drive(tmp_path, "refit", steps=2, sizes=COLOCATED)
    assert "init_error" not in out, out["init_error"]
    assert "Megatron tp=2,pp=2,vpp=1,cp=1,dp=1,ep=1,etp=2 -> vLLM tp=2,pp=1,dp=2," in out["plan"]
    assert "; colocated: " in out["plan"], out["plan"]
    # Policy rank r hosts the vLLM worker on its GPU: refit rank 4 + d for d on gpu{3-d}.
    assert out["guests"] == [7, 6, 5, 4]
    first, second = out["steps"]
    assert (first["stale_before"], first["stale_after"]) == (True, False)
    assert (second["stale_before"], second["stale_after"]) == (False, False)
    for step in out["steps"]:
        assert step["differ"] == [[]] * 4, step
    cycle = ["prepare_for_training", "offload_before_refit", "reshard_step", "offload_after_refit"]
    assert out["policy_calls"] == [cycle * 2] * 4
    wake = ["sleep(1)", "wake_up(['weights'])", "wake_up(['kv_cache'])"]
    assert out["vllm_calls"] == [wake * 2] * 4
    assert out["closed"] is True


def test_colocated_refit_of_offloaded_policy_is_refused(tmp_path: Path) -> None:
    """A refit while the policy's parameters are still offloaded (no
    ``prepare_for_training`` before it) reads no stale or empty memory: every policy rank
    refuses by name, the sync raises and the weights stay stale."""
    out = drive(tmp_path, "offloaded", steps=2, sizes=COLOCATED)
    first, second = out["steps"]
    assert first["differ"] == [[]] * 4
    error = second["error"]
    assert error.startswith("RuntimeError: refit step 2 failed on 6 worker(s):"), error
    for r in range(4):
        assert (
            f"policy rank {r}: PlanError: Megatron policy rank {r}: the parameters the refit "
            "reads are not the model's live ones"
        ) in error, error
    assert "offloaded (its storage holds no data now)" in error
    # Each vLLM worker hears at once from its host (no wait for the refit timeout).
    for e in range(2):
        assert (
            f"vLLM engine {e}: TransportError: colocated refit: the training rank on this GPU "
            "failed in round 0: PlanError: Megatron policy rank"
        ) in error, error
    assert second["stale_after"] is True
    # NeMo RL's lifecycle still ran around the failed transfer.
    assert out["policy_calls"][0][-2:] == ["reshard_step", "offload_after_refit"]


@pytest.mark.parametrize(
    "gpus, message",
    [
        (
            {"policy": ["gpu0", "gpu0", "gpu2", "gpu3"], "vllm": ["gpu0", "gpu1", "gpu2", "gpu3"]},
            "PlanError: colocated refit: GPU {host}:gpu0 hosts training ranks 0 and 1; each "
            "GPU must host one training rank (fix the placement)",
        ),
        (
            {"policy": ["gpu0", "gpu1", "gpu2", "gpu3"], "vllm": ["gpu0", "gpu1", "gpu2", "gpu9"]},
            "PlanError: colocated refit: inference rank 3 on GPU {host}:gpu9 has no training "
            "rank on its GPU; place one there or run the separate-pools refit",
        ),
    ],
    ids=["two-policy-ranks", "vllm-alone"],
)
def test_colocated_bad_placement_is_one_line(tmp_path: Path, gpus: dict, message: str) -> None:
    import socket

    out = drive(tmp_path, "refit", steps=1, sizes=dict(COLOCATED, gpus=gpus))
    assert out["init_error"] == message.format(host=socket.gethostname())
    assert "steps" not in out
