"""Build SGLang's Qwen3 (MODELS["qwen3"]) on CPU at tp=1 and print its parameters.

Run under the SGLang venv: ``PYTHONPATH=. .venv-sglang/bin/python tests/programs/sglang_probe.py``.
Draft (tp=1 only; tp=2 and ``load_weights`` not done yet). Stand-ins: torchvision
(tests/helpers/sglang_cpu.py) and the rope module's ``_is_cpu`` flag (SGLang detects the
CPU platform only for its own CPU build; otherwise rope imports ``vllm._custom_ops``).
"""

import transformers

from tests.helpers.model_configs import MODELS
from tests.helpers.sglang_cpu import stub_torchvision

stub_torchvision()

import sglang.srt.layers.rotary_embedding.base as rope_base  # noqa: E402
from sglang.srt.distributed import parallel_state as ps  # noqa: E402
from sglang.srt.models.qwen3 import Qwen3ForCausalLM  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402


def main() -> None:
    """Publish minimal server args, build gloo groups, construct the model, print shapes."""
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", tp_size=1, device="cpu"))
    ps.init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method="tcp://127.0.0.1:29612",
        local_rank=0,
        backend="gloo",
    )
    ps.initialize_model_parallel(backend="gloo")
    rope_base._is_cpu = True  # stand-in 2: the torch-native rope path
    config = transformers.AutoConfig.for_model(**MODELS["qwen3"])
    with get_parallel().override(tp_rank=0, pp_rank=0):  # stand-in 3: ranks not published
        model = Qwen3ForCausalLM(config)
    for name, param in model.named_parameters():
        print(name, tuple(param.shape))


if __name__ == "__main__":
    main()
