"""The vLLM interfaces we pin: the `.[vllm]` extra names the tested release range, the
runtime `torch` requirement pins no single version, and the plugin refuses a vLLM whose
weight-transfer API moved, by name, instead of failing inside a refit.

The incompatible vLLM is a stand-in package written here (a vLLM whose
``TrainerWeightTransferEngine.trainer_init`` takes a new required keyword and whose
``send_weights`` takes the weights): no released vLLM has that API yet, and the stand-in
has only the modules ``register()`` reads. The compatible case is the real vLLM 0.33.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tomllib

from nemo_refit_reshard.integrations.vllm.api_check import SUPPORTED_RANGE, SUPPORTED_VLLM
from nemo_refit_reshard.layouts.vllm_releases import VLLM_RELEASES
from tests.helpers import vllm_env
from tests.helpers.requires import requires

REPO = Path(__file__).resolve().parents[1]

_BASE_033 = """
class WeightTransferEngine:
    def __init__(self, config, vllm_config, device, model): ...
    def init_transfer_engine(self, init_info): ...
    def start_weight_update(self): ...
    def update_weights(self, update_info): ...
    def receive_weights(self, update_info): ...
    def finish_weight_update(self): ...
    def shutdown(self): ...

class TrainerWeightTransferEngine:
    def __init__(self, *, client, source=None, is_sender=True, rank=0): ...
    @classmethod
    def trainer_init(cls, init_info, *, client, source=None): ...
    def send_weights(self): ...

class VLLMWeightSyncClient:
    def init_weight_transfer_engine(self, init_info): ...
    def start_weight_update(self): ...
    def update_weights(self, update_info): ...
    def finish_weight_update(self, weight_version=None): ...
"""

_NEWER = _BASE_033.replace(
    "def trainer_init(cls, init_info, *, client, source=None)",
    "def trainer_init(cls, init_info, *, client, source=None, group)",
).replace("def send_weights(self)", "def send_weights(self, weights)")

_FACTORY = """
class _Factory:
    def __init_subclass__(cls):
        cls._registry = {}
    @classmethod
    def register_engine(cls, name, module_path_or_cls, class_name=None):
        if name in cls._registry:
            raise ValueError(f"engine {name!r} is already registered.")
        cls._registry[name] = module_path_or_cls

class WeightTransferEngineFactory(_Factory):
    @classmethod
    def create_engine(cls, config, vllm_config, device, model):
        return cls._registry[config.backend](config, vllm_config, device, model)

class WeightTransferTrainerFactory(_Factory):
    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        return cls._registry[init_info.backend].trainer_init(init_info, client=client)
"""

_PROBE = """
import json, logging, types
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from nemo_refit_reshard.integrations.vllm.plugin import register
from vllm.distributed.weight_transfer import factory as F
register(); register()
out = {}
try:
    F.WeightTransferEngineFactory.create_engine(
        types.SimpleNamespace(backend="reshard"), None, "cpu", None)
except Exception as err:
    out["worker"] = f"{type(err).__name__}: {err}"
try:
    F.WeightTransferTrainerFactory.trainer_init(
        types.SimpleNamespace(backend="reshard"), client=None)
except Exception as err:
    out["trainer"] = f"{type(err).__name__}: {err}"
out["registered"] = {k: str(v) for k, v in F.WeightTransferEngineFactory._registry.items()}
print(json.dumps(out))
"""


def _stand_in_vllm(root: Path, version: str, base: str) -> Path:
    pkg = root / "vllm"
    (pkg / "distributed" / "weight_transfer").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (pkg / "distributed" / "__init__.py").write_text("")
    (pkg / "distributed" / "weight_transfer" / "__init__.py").write_text("")
    (pkg / "distributed" / "weight_transfer" / "base.py").write_text(textwrap.dedent(base))
    (pkg / "distributed" / "weight_transfer" / "factory.py").write_text(_FACTORY)
    return root


def _probe(root: Path) -> tuple[dict, str]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE],
        cwd=REPO,
        env={"PYTHONPATH": f"{root}:{REPO}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


EXPECTED_LINE = (
    "nemo-refit-reshard: the 'reshard' weight-transfer backend supports vLLM 0.33.x's "
    "weight-transfer API; vLLM 0.40.0 differs: TrainerWeightTransferEngine.trainer_init"
    "(init_info, *, client, source=…, group) (expected (init_info, *, client, source=…)); "
    "TrainerWeightTransferEngine.send_weights(weights) (expected ()). Install "
    "vllm>=0.33,<0.34 (pip install 'nemo-refit-reshard[vllm]'), or refit through "
    "worker_extension_cls, NeMo RL or veRL, which do not use this API"
)


@pytest.mark.slow
def test_a_vllm_with_a_newer_weight_transfer_api_is_refused_by_name(tmp_path: Path) -> None:
    out, log = _probe(_stand_in_vllm(tmp_path, "0.40.0", _NEWER))
    # one warning at start-up (register() twice: once), the same line when selected
    assert log.count("nemo-refit-reshard: the 'reshard'") == 1, log
    assert EXPECTED_LINE in log
    assert out["worker"] == f"IncompatibleVllmError: {EXPECTED_LINE}"
    assert out["trainer"] == f"IncompatibleVllmError: {EXPECTED_LINE}"


@pytest.mark.slow
def test_the_tested_api_registers_our_engines(tmp_path: Path) -> None:
    """Control: the stand-in with 0.33's signatures gets the real (lazy) engines."""
    out, log = _probe(_stand_in_vllm(tmp_path, "0.33.0", _BASE_033))
    assert "differs" not in log, log
    assert out["registered"] == {"reshard": "nemo_refit_reshard.integrations.vllm.transfer_worker"}


@pytest.mark.slow
@requires(vllm_env.skip_reason)
def test_real_vllm_033_has_the_api_we_are_written_against() -> None:
    python = vllm_env.vllm_python()
    code = (
        "from vllm.distributed.weight_transfer import base\n"
        "from nemo_refit_reshard.integrations.vllm.api_check import api_problems\n"
        "import vllm; print(vllm.__version__, api_problems(base))"
    )
    done = subprocess.run(
        [python, "-c", code], cwd=REPO, env=vllm_env.vllm_env(), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "0.33.0 []"


def test_extras_pin_the_tested_vllm_and_no_single_torch() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["vllm"] == [SUPPORTED_RANGE]
    assert SUPPORTED_VLLM in VLLM_RELEASES  # the layouts know the release we pin
    torch_reqs = [r for r in project["dependencies"] if r.split(">")[0].split("=")[0] == "torch"]
    assert torch_reqs == ["torch>=2.6"], torch_reqs  # never `==`: keep a CUDA env's torch
