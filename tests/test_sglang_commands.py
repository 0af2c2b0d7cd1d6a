"""The refit commands a driver sends SGLang (``integrations/sglang/loader.py``): one entry
per operation, its JSON arguments in the name and an empty tensor, serialized without
SGLang exactly as SGLang's own ``MultiprocessingSerializer`` does, and read back by
SGLang's ``SafeUnpickler``."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from nemo_refit_reshard.integrations.sglang.loader import (
    LOADER,
    _decode,
    refit_command,
    serialized_refit_command,
)
from tests.helpers import vllm_env
from tests.helpers.requires import requires


def test_command_carries_its_arguments_in_the_name() -> None:
    [(name, tensor)] = refit_command("step", step=3)
    assert name == 'nemo_refit_reshard.step?{"step": 3}'
    assert (tensor.dtype, tensor.numel()) == (torch.uint8, 0)
    assert _decode(name, tensor) == ("step", {"step": 3})
    assert _decode("nemo_refit_reshard.close?{}", tensor) == ("close", {})


@pytest.mark.parametrize(
    "name, tensor",
    [
        ("model.layers.0.mlp.down_proj.weight", torch.empty(0, dtype=torch.uint8)),
        ('nemo_refit_reshard.stepp?{"step": 3}', torch.empty(0, dtype=torch.uint8)),
        ('nemo_refit_reshard.step?{"step": 3}', torch.zeros(4)),  # weights, not a command
    ],
)
def test_weights_are_not_commands(name: str, tensor: torch.Tensor) -> None:
    with pytest.raises(ValueError) as err:
        _decode(name, tensor)
    assert str(err.value) == (
        f"{name!r} is not a refit command: with load_format={LOADER!r} send "
        "refit_command(...), not weights"
    )


def test_unknown_operation_is_refused() -> None:
    with pytest.raises(ValueError) as err:
        refit_command("restart")
    assert str(err.value) == (
        "unknown refit operation 'restart'; choose from ['close', 'connect_colocated', "
        "'join', 'load_plan', 'step']"
    )


PROBE = """
import json, sys
from tests.helpers.sglang_cpu import stub_torchvision
stub_torchvision()  # 0.5.12.post1's `import sglang` imports torchvision.io
from sglang.srt.utils import MultiprocessingSerializer
from nemo_refit_reshard.integrations.sglang.loader import _decode, refit_command
sent = json.loads(sys.stdin.read())
[(name, tensor)] = MultiprocessingSerializer.deserialize(sent[1])  # SafeUnpickler
ours = MultiprocessingSerializer.serialize(refit_command("load_plan", **sent[0]), output_str=True)
print(json.dumps({"decoded": _decode(name, tensor), "same": ours == sent[1]}))
"""


@pytest.mark.slow
@requires(vllm_env.sglang_skip_reason)
def test_sglang_reads_what_a_driver_without_sglang_serialized() -> None:
    """Serialized here (no SGLang), read by SGLang 0.5.23's own deserializer in its venv:
    the same command, and byte for byte what SGLang's serializer makes of it."""
    arguments = {"plan": {"3": "{...}"}, "fingerprint": "ab" * 32}
    payloads = serialized_refit_command("load_plan", 2, **arguments)
    assert len(payloads) == 2 and payloads[0] == payloads[1]
    python = vllm_env.sglang_python()
    assert python is not None
    done = subprocess.run(
        [python, "-c", PROBE],
        input=json.dumps([arguments, payloads[0]]),
        capture_output=True,
        text=True,
        cwd=vllm_env.REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"decoded": ["load_plan", arguments], "same": True}
