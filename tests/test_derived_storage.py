"""A rerun that rebinds a derived tensor is put back on its storage (``derived._keep_storage``).

vLLM 0.33's ``replace_parameter`` rebinds a parameter's ``.data`` when the new tensor's
stride differs, and 0.25's ``MLAAttention`` assigns ``self.W_UV = ...``: either would
leave a captured CUDA graph reading the previous step's tensor. The worker copies the
rerun's values into the previous storage and puts it back. A stand-in module holds the
two kinds of derived tensor (a parameter and a plain tensor); vLLM's own MLA classes are
exercised in ``tests/test_vllm_derived.py``. The GPU test replays a CUDA graph captured
before the refit.
"""

from __future__ import annotations

import pytest
import torch

from nemo_refit_reshard.integrations.vllm.derived import DerivedWeightsMoved, _keep_storage


def _layer(device: str) -> torch.nn.Module:
    """``W_UV`` a parameter over a transposed copy (as vLLM 0.33 registers it), ``W_UK_T``
    a plain tensor (as vLLM 0.25 assigns it)."""
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Module()
    # Small integers: every product below is exact in float32, whatever order cuBLAS sums
    # in, so a graph's output and an eager one compare with torch.equal.
    w_uv = _ints((8, 4, 6), g).to(device).transpose(0, 1)  # (4, 8, 6), strides (6, 24, 1)
    layer.W_UV = torch.nn.Parameter(w_uv, requires_grad=False)
    layer.W_UK_T = _ints((4, 5, 8), g).to(device)
    return layer


def _ints(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return torch.randint(-4, 5, shape, generator=g).float()


def _graph_inputs(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The left operands of the graph's two batched products: ``x @ W_UV`` is
    (4, 3, 8) x (4, 8, 6), ``y @ W_UK_T`` is (4, 3, 5) x (4, 5, 8)."""
    g = torch.Generator().manual_seed(1)
    return _ints((4, 3, 8), g).to(device), _ints((4, 3, 5), g).to(device)


def _rerun(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a rebinding rerun does: new storage with new values; returns those values."""
    new_uv = (layer.W_UV.data.transpose(0, 1) + 1).contiguous().transpose(0, 1)
    new_uk = layer.W_UK_T + 2
    layer.W_UV.data = new_uv
    layer.W_UK_T = new_uk
    return {"W_UV": new_uv.clone(), "W_UK_T": new_uk.clone()}


def _before(layer: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {a: (getattr(layer, a), getattr(layer, a).data) for a in ("W_UV", "W_UK_T")}


def test_rebound_derived_tensors_return_to_their_storage() -> None:
    layer = _layer("cpu")
    before = _before(layer)
    pointers = {a: t.data_ptr() for a, (t, _) in before.items()}
    param = layer.W_UV
    want = _rerun(layer)
    assert layer.W_UV.data_ptr() != pointers["W_UV"]  # the rerun moved both ...
    assert layer.W_UK_T.data_ptr() != pointers["W_UK_T"]
    _keep_storage("layer", layer, before)
    assert {a: getattr(layer, a).data_ptr() for a in pointers} == pointers  # ... back
    assert layer.W_UV is param and layer.W_UV.stride() == (6, 24, 1)
    for a, t in want.items():
        assert torch.equal(getattr(layer, a), t), a


def test_derived_tensor_of_another_shape_is_refused() -> None:
    layer = _layer("cpu")
    before = _before(layer)
    layer.W_UK_T = torch.zeros(4, 5, 9)
    with pytest.raises(DerivedWeightsMoved) as err:
        _keep_storage("model.layers.0.self_attn.mla_attn", layer, before)
    assert str(err.value) == (
        "model.layers.0.self_attn.mla_attn.W_UK_T: vLLM's process_weights_after_loading "
        "gave a tensor of another shape, stride or dtype after a refit; captured CUDA graphs "
        "would read the previous step's (serve with enforce_eager=True)"
    )


def test_the_graphs_products_are_well_formed_and_see_the_rerun() -> None:
    """The CPU half of the CUDA-graph test below: its two products are well formed, and
    the rerun's values change both (so a graph reading the previous step's tensors would
    fail that test's comparison)."""
    layer = _layer("cpu")
    x, y = _graph_inputs("cpu")
    before = (torch.bmm(x, layer.W_UV), torch.bmm(y, layer.W_UK_T))
    assert [tuple(t.shape) for t in before] == [(4, 3, 6), (4, 3, 8)]
    want = _rerun(layer)
    after = (torch.bmm(x, want["W_UV"]), torch.bmm(y, want["W_UK_T"]))
    assert not torch.equal(before[0], after[0]) and not torch.equal(before[1], after[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_captured_before_the_refit_reads_the_new_tensors() -> None:
    """A graph captured on the derived tensors replays with the rerun's values once they
    are put back (without that, it would read the previous step's)."""
    layer = _layer("cuda")
    x, y = _graph_inputs("cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (cuBLAS handle, workspace) before capture
        torch.bmm(x, layer.W_UV)
        torch.bmm(y, layer.W_UK_T)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out_uv = torch.bmm(x, layer.W_UV)
        out_uk = torch.bmm(y, layer.W_UK_T)
    before = _before(layer)
    want = _rerun(layer)
    _keep_storage("layer", layer, before)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_uv, torch.bmm(x, want["W_UV"]))
    assert torch.equal(out_uk, torch.bmm(y, want["W_UK_T"]))
