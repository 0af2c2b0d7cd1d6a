"""One block-FP8 DeepSeek-V3 vLLM rank in the derived-tensor test (run with vLLM's Python).

    python -m tests.programs.vllm_derived_check SPEC.json RESULT.json

SPEC: ``{"config", "rank": EngineRank fields, "endpoint", "first_rank", "plan",
"initial", "checkpoints": [one FP8 safetensors path per step], "dtype", "mode"}``.

vLLM's own ``DeepseekV3ForCausalLM`` with its block-FP8 ``Fp8Config`` is built on CPU,
loaded and processed by vLLM's own ``process_weights_after_loading`` (its MLA layers
derive ``W_UK_T``/``W_UV`` from the dequantized ``kv_b_proj``), then refit through the
worker functions (``integrations/vllm/worker.py``, dispatched by vLLM's ``run_method``).
After every step, what the engine holds is compared, bit for bit, with a second model
loaded and processed by vLLM from that step's checkpoint: the refit parameters, and
the derived tensors of every MLA layer; and no storage (derived tensors included) may
have moved. Modes: ``rerun``; ``skip_rerun``, the control, whose worker writes the
parameters only; ``rebind``, whose MLA layers' ``replace_parameter`` rebinds the
parameter's storage on every call after start-up instead of copying into it (what 0.33
does when the stride differs, and 0.25's ``self.W_UV = ...`` does always).

Stand-ins: vLLM's choice of FP8 kernel (``vllm_cpu.allow_fp8_block_kernel_on_cpu``: the
Triton block kernel a CUDA GPU without DeepGEMM picks; no FP8 matmul runs); a CPU with
AMX tiles reads as one without, so that vLLM picks its reference CPU MLA backend, whose
MLA layers derive ``W_UK_T``/``W_UV`` as on a GPU (AMX MLA is refused by name); in
``rebind`` mode the rebinding ``replace_parameter``.
"""

from __future__ import annotations

import json
import sys
import traceback

import torch

from nemo_refit_reshard.integrations import vllm as refit_vllm
from tests.helpers import vllm_cpu
from tests.programs.vllm_refit_rank import ExtendedWorker, StandInWorker, load

DERIVED = ("W_UK_T", "W_UV")


def derived_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every MLA layer's ``W_UK_T`` / ``W_UV``, by full name (registered by vLLM's
    ``replace_parameter`` as parameters of the MLAAttention module)."""
    from vllm.model_executor.layers.attention import MLAAttention

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, MLAAttention):
            for attr in DERIVED:
                out[f"{name}.{attr}"] = getattr(module, attr)
    return out


def refused(model: torch.nn.Module, config: object) -> str:
    """The error a fresh worker gives once MLA layers use DCP query replication and AMX
    (set on this model's layers, after its refit)."""
    from vllm.model_executor.layers.attention import MLAAttention

    layers = [m for m in model.modules() if isinstance(m, MLAAttention)]
    layers[0].dcp_q_replicate = True
    layers[1].is_amx_bmm_enabled = True
    try:
        refit_vllm.refit_describe(StandInWorker(model, config))
    except Exception as err:  # noqa: BLE001 - the test asserts on its text
        return f"{type(err).__name__}: {err}"
    return "not refused"


def rebind_after_start_up() -> None:
    """MLA's ``replace_parameter`` rebinds an existing parameter's ``.data`` (vLLM 0.33's
    own branch for a tensor of another stride) instead of copying into it."""
    from vllm.model_executor.layers.attention import mla_attention

    original = mla_attention.replace_parameter

    def rebind(layer: torch.nn.Module, name: str, new: torch.Tensor | None) -> None:
        old = getattr(layer, name, None)
        if isinstance(old, torch.nn.Parameter) and new is not None:
            old.data = new.data
            return
        original(layer, name, new)

    mla_attention.replace_parameter = rebind


def main(spec_path: str, result_path: str) -> None:
    from vllm.v1.serial_utils import run_method

    spec = json.load(open(spec_path))
    rank = vllm_cpu.EngineRank.from_dict(spec["rank"])
    result: dict[str, object] = {"ok": False}
    try:
        torch.cpu._is_amx_tile_supported = lambda: False  # the GPU's MLA path, not AMX's
        if spec["mode"] == "skip_rerun":
            try:
                from nemo_refit_reshard.integrations.vllm.derived import DerivedWeights
            except ImportError:  # a worker without the rerun: nothing to skip
                pass
            else:
                DerivedWeights.rerun = lambda self: None  # type: ignore[method-assign]
        model, config = vllm_cpu.build_model(spec["config"], rank, "cpu", spec["dtype"])
        worker = ExtendedWorker(model, config)

        def call(op: str, *args: object) -> object:
            return run_method(worker, op, args, {})

        load(model, config, spec["initial"])
        if spec["mode"] == "rebind":
            rebind_after_start_up()
        derived = derived_tensors(model)
        # block-FP8: the derived tensors are copies (dequantized), not views of kv_b_proj
        kv_b = {n: model.get_submodule(n.rsplit(".", 1)[0]).kv_b_proj.weight for n in derived}
        result["copies"] = sorted(
            n
            for n, t in derived.items()
            if t.untyped_storage().data_ptr() != kv_b[n].untyped_storage().data_ptr()
        )
        pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
        pointers.update({n: t.data_ptr() for n, t in derived.items()})
        described = call("refit_describe")
        call("refit_join", spec["endpoint"], spec["first_rank"])
        written = call("refit_load_plan", spec["plan"])
        steps = []
        for path in spec["checkpoints"]:
            timing = call("refit_step")
            truth, truth_config = vllm_cpu.build_model(spec["config"], rank, "cpu", spec["dtype"])
            load(truth, truth_config, path)
            want = dict(truth.named_parameters())
            want_derived = derived_tensors(truth)
            now = derived_tensors(model)
            steps.append(
                {
                    "differ": [
                        n
                        for n, p in model.named_parameters()
                        if n not in derived and not torch.equal(p, want[n])
                    ],
                    "derived_differ": [
                        n for n, t in now.items() if not torch.equal(t, want_derived[n])
                    ],
                    "moved": [
                        n
                        for n, p in [*model.named_parameters(), *now.items()]
                        if p.data_ptr() != pointers[n]
                    ],
                    "timing": timing,
                }
            )
        call("refit_close")
        result["refused"] = refused(model, config)
        result.update(
            ok=True,
            written=written,
            derived=sorted(derived),
            described=sorted(described["tensors"]),  # type: ignore[index]
            steps=steps,
        )
    except BaseException as err:  # reported to the test, which asserts on it
        result["error"] = f"{type(err).__name__}: {err}"
        result["traceback"] = traceback.format_exc()
    finally:
        with open(result_path, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
