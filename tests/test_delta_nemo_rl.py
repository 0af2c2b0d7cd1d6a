"""``refit.delta`` through NeMo RL's real GRPO refit, worker and config classes.

The same driver as tests/test_nemo_rl_reshard.py (``tests/programs/nemo_rl_reshard_driver.py``
in NeMo RL's Python: GRPO's ``refit_policy_generation`` calls our synchronizer, real
Megatron-core shards go into vLLM 0.25.1's own model classes), with ``refit.delta: true``
and checkpoints that change a small fraction of each tensor per step (as RL updates
do), loaded into the live Megatron parameters in place before each refit. Three refits,
separate pools and colocated (NeMo RL's colocated lifecycle around each):

* after each, every vLLM parameter equals vLLM's own load of that step's checkpoint;
* the first refit is dense (nothing held yet), every later one sends the policy ranks'
  messages as deltas: well under the dense bytes, which GRPO's refit reports.

Fast tests: the ``refit:`` block's delta keys and their errors (no NeMo RL needed), and
the overlays through NeMo RL's loader and Hydra override parser.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from nemo_refit_reshard.engine.delta import DeltaOptions
from nemo_refit_reshard.integrations.nemo_rl.config import NemoRlConfigError, RefitConfig
from nemo_refit_reshard.spec import spec_from_hf_config
from tests.helpers import vllm_env
from tests.helpers.model_configs import MODELS
from tests.helpers.requires import requires
from tests.helpers.sparse_checkpoints import write_sparse_steps

NEMO_RL = requires(vllm_env.nemo_rl_grpo_skip_reason)
FRACTION = 0.02  # of each tensor's elements changed per step
STEPS = 3

SEPARATE = dict(train="tp=2", megatron_cfg={"tensor_model_parallel_size": 2}, vllm_tp=2, vllm_pp=1)
# Megatron tp=2,pp=2 and two vLLM engines of tp=2 on the same 4 GPUs (vLLM rank d on the
# GPU of policy rank 3-d), as in tests/test_nemo_rl_reshard.py.
COLOCATED = dict(
    train="tp=2,pp=2",
    megatron_cfg={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    vllm_tp=2,
    vllm_pp=1,
    gpus={"policy": ["gpu0", "gpu1", "gpu2", "gpu3"], "vllm": ["gpu3", "gpu2", "gpu1", "gpu0"]},
)
FOUR_LAYERS = {"num_hidden_layers": 4, "layer_types": ["full_attention"] * 4}  # pp=2 splits it


def drive_delta(tmp: Path, sizes: dict) -> dict:
    """Run the NeMo RL driver over ``STEPS`` sparse updates with ``refit.delta: true``."""
    cfg = dict(MODELS["qwen3"], **(FOUR_LAYERS if "pp=2" in sizes["train"] else {}))
    (tmp / "config.json").write_text(json.dumps(cfg))
    checkpoints = write_sparse_steps(spec_from_hf_config(cfg), tmp, STEPS, 700, FRACTION)
    spec = dict(
        config=cfg,
        model_dir=str(tmp),
        engines=2,
        **sizes,
        checkpoints=checkpoints,
        scenario="refit",
        refit={
            "backend": "reshard",
            "transport": "gloo",
            "host": "127.0.0.1",
            "timeout_s": 120,
            "delta": True,
        },
    )
    spec_path, result = tmp / "spec.json", tmp / "result.json"
    spec_path.write_text(json.dumps(spec))
    python = vllm_env.nemo_rl_grpo_python()
    proc = vllm_env.start("nemo_rl_reshard_driver", str(spec_path), str(result), python=python)
    vllm_env.finish(proc, "NeMo RL reshard driver (delta)")
    out = json.loads(result.read_text())
    assert "error" not in out, out.get("traceback")
    assert "init_error" not in out, out["init_error"]
    return out


@pytest.mark.slow
@NEMO_RL
@pytest.mark.parametrize("sizes", [SEPARATE, COLOCATED], ids=["separate", "colocated"])
def test_delta_refits_through_nemo_rl_are_bit_exact_and_smaller(
    tmp_path: Path, sizes: dict
) -> None:
    out = drive_delta(tmp_path, sizes)
    assert ("; colocated: " in out["plan"]) == ("gpus" in sizes), out["plan"]
    steps = out["steps"]
    assert len(steps) == STEPS
    dense = steps[0]["metrics"]["reshard/delta_dense_bytes"]
    assert dense > 0
    for k, step in enumerate(steps, start=1):
        assert "error" not in step, step["error"]
        assert step["differ"] == [[]] * 4, (k, step["differ"])
        sent = step["metrics"]["reshard/delta_sent_bytes"]
        assert step["metrics"]["reshard/delta_dense_bytes"] == dense
        if k == 1:  # nothing held yet: whole messages (and their headers)
            assert sent >= dense, (k, sent, dense)
        else:  # 2 % of the elements changed: a bitmap and the changed values
            assert 0 < sent < dense / 4, (k, sent, dense)
    assert out["closed"] is True


def test_delta_keys_of_the_refit_block() -> None:
    assert RefitConfig.from_config({"backend": "reshard"}).delta_options is None
    cfg = RefitConfig.from_config(
        {"backend": "reshard", "delta": True, "delta_anchor_every": 8, "delta_baseline": "host"}
    )
    assert cfg.delta_options == DeltaOptions(anchor_every=8, baseline="host")


@pytest.mark.parametrize(
    "block, message",
    [
        (
            {"backend": "nccl", "delta": True},
            "refit.delta=true needs refit.backend=reshard (delta refit sends the reshard "
            "plan's messages in their smallest form; NeMo RL's nccl refit sends whole "
            "tensors); set refit.backend=reshard, or refit.delta=false",
        ),
        (
            {"backend": "reshard", "delta_anchor_every": 4},
            "refit.delta_anchor_every=4 applies to delta refits only; set refit.delta=true, "
            "or drop it",
        ),
        ({"backend": "reshard", "delta": "on"}, "refit.delta='on' must be true or false"),
        (
            {"backend": "reshard", "delta": True, "delta_baseline": "disk"},
            "refit.delta_baseline='disk' is not one of auto, device, host",
        ),
        (
            {"backend": "reshard", "delta": True, "delta_anchor_every": -2},
            "refit.delta_anchor_every=-2 must be an integer >= 0",
        ),
    ],
    ids=["nccl", "anchor-alone", "not-bool", "baseline", "negative"],
)
def test_delta_errors_name_the_key(block: dict, message: str) -> None:
    with pytest.raises(NemoRlConfigError) as err:
        RefitConfig.from_config(block)
    assert str(err.value) == message


@pytest.mark.slow
@NEMO_RL
def test_overlays_turn_delta_on_by_hydra_override() -> None:
    """Every reshard overlay says ``refit.delta: false``; ``refit.delta=true`` on the
    command line (NeMo RL's loader and Hydra override parser) turns it on, and with
    ``refit.backend=nccl`` NeMo RL's launcher stops with the one-line error."""
    configs = vllm_env.REPO / "configs" / "nemo_rl"
    example = vllm_env.REPO / "examples" / "nemo_rl" / "run_grpo.py"
    names = sorted(p.name for p in configs.glob("*_reshard*.yaml") if "engine" not in p.name)
    probe = f"""
import importlib.util, json
spec = importlib.util.spec_from_file_location("run_grpo", {str(example)!r})
run_grpo = importlib.util.module_from_spec(spec); spec.loader.exec_module(run_grpo)
from nemo_refit_reshard.integrations.nemo_rl.grpo import refit_config
out = {{}}
for name in {names!r}:
    for overrides in ([], ["refit.delta=true", "refit.delta_anchor_every=16"]):
        raw = run_grpo.load({str(configs)!r} + "/" + name, overrides, None)
        out[name + str(len(overrides))] = repr(refit_config(raw).delta_options)
print(json.dumps(out))
"""
    python = vllm_env.nemo_rl_grpo_python()
    assert python is not None
    got = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr[-3000:]
    out = json.loads(got.stdout.strip().splitlines()[-1])
    assert len(names) == 5, names  # SGLang's refuses delta=true later (check_reshard_config)
    for name in names:
        assert out[name + "0"] == "None"
        assert out[name + "2"] == (
            "DeltaOptions(anchor_every=16, baseline='auto', cpu_kernel='auto', check=None)"
        )
    bad = subprocess.run(
        [python, str(example), "--config", str(configs / names[0]), "refit.delta=true"]
        + ["refit.backend=nccl"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert (
        bad.stderr.strip()
        .splitlines()[-1]
        .startswith("error: refit.delta=true needs refit.backend=reshard")
    ), bad.stderr[-3000:]
