"""vLLM release selection and the rules that differ between releases (no vLLM needed)."""

from __future__ import annotations

import pytest

from nemo_refit_reshard.layouts import VllmOptions, vllm_layout, vllm_release, vllm_releases
from nemo_refit_reshard.spec import InferParallel, load_model_spec


def test_release_by_version_string() -> None:
    assert vllm_release("0.33.0").expert_module == "experts.routed_experts"
    assert vllm_release("0.25.1+cu128").version == "0.25"
    assert vllm_release("0.11.2").expert_module == "experts"


def test_unknown_release_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError) as err:
        vllm_layout(
            load_model_spec("small-qwen3"),
            InferParallel(tp=2),
            0,
            VllmOptions(vllm_version="0.7.3"),
        )
    assert str(err.value).startswith(
        "vLLM 0.7.3 is not a release whose parameter layout this provider knows; "
        "known: 0.11.x, 0.24.x, 0.25.x, 0.33.x."
    )


def test_default_release_is_the_installed_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # vllm_release looks installed_vllm_version up in its own module: patch it there.
    assert vllm_release.__module__ == vllm_releases.__name__
    monkeypatch.setattr(vllm_releases, "installed_vllm_version", lambda: "0.25.1")
    assert vllm_release().version == "0.25"
    monkeypatch.setattr(vllm_releases, "installed_vllm_version", lambda: None)
    assert vllm_release().version == "0.33"
    monkeypatch.setattr(vllm_releases, "installed_vllm_version", lambda: "0.30.0")
    with pytest.raises(ValueError, match=r"vLLM 0\.30\.0 \(the installed vLLM\) is not a release"):
        vllm_release()


@pytest.mark.parametrize(
    "par, backend, expected",
    [
        (InferParallel(tp=2, engine_dp=2, ep=4), None, True),
        (InferParallel(tp=2, engine_dp=2, ep=4), "naive", True),  # removed: falls back
        (InferParallel(tp=2, engine_dp=2, ep=4), "flashinfer_nvlink_two_sided", False),
        (InferParallel(tp=2, engine_dp=2), None, False),  # no expert parallel
        (InferParallel(tp=1, engine_dp=2, ep=2), None, False),
        (InferParallel(tp=2, ep=2), None, False),  # engine_dp = 1
    ],
)
def test_sequence_parallel_moe_rule(
    par: InferParallel, backend: str | None, expected: bool
) -> None:
    opts = VllmOptions(vllm_version="0.33.0", all2all_backend=backend)
    assert opts.sequence_parallel_moe(par) is expected


def test_shared_experts_whole_under_sequence_parallel_moe() -> None:
    spec = load_model_spec("deepseek-v3")
    name = "model.layers.3.mlp.shared_experts.gate_up_proj.weight"
    opts = VllmOptions(vllm_version="0.33.0")
    sp = vllm_layout(spec, InferParallel(tp=8, engine_dp=2, ep=16), 5, opts)
    plain = vllm_layout(spec, InferParallel(tp=8, ep=8), 5, opts)
    assert {t.name: t.shape for t in sp.tensors}[name] == (2 * 2048, 7168)
    assert {t.name: t.shape for t in plain.tensors}[name] == (2 * 2048 // 8, 7168)
