"""Where an SGLang 0.5.23 inference rank sits: the layers its pipeline stage builds
(:func:`sglang_pp_indices`) and the ranks that hold the same pieces
(:func:`sglang_replicas`). Ranks are numbered as vLLM's are (``vllm_grid.vllm_position``)::

    rank = ((replica·engine_dp + edp)·pp + pp_rank)·tp + tp_rank

with ``engine_dp`` > 1 (data-parallel attention) only where ``pp`` = 1: there an engine's
rank ``edp·tp + tp_rank`` is SGLang's tp rank ``attn_dp_rank·attn_tp_size +
attn_tp_rank`` (``runtime_context.derive_attention_ranks``, attention cp = 1).

Inside one engine that is SGLang's own world rank ``pp_rank·tp + tp_rank``
(``runtime_context.spawn_world_rank``): its launcher starts the scheduler processes
pp-major (``entrypoints/engine.py``: ``for pp_rank ..: for tp_rank ..``), its tensor-parallel
groups are the contiguous blocks ``[k·tp, (k+1)·tp)`` and its pipeline groups the strides
``tp_rank + k·tp`` (``distributed/parallel_state.py::initialize_model_parallel``).

SGLang's pipeline split (``distributed/utils.py::get_pp_indices``) differs from vLLM's: with
L layers over P stages, every stage gets ``L//P`` layers and the *last* ``L%P`` stages one
more (vLLM gives the extra layers to stages ``P-2, P-3, ...``). ``SGLANG_PP_LAYER_PARTITION``
(layer count per stage, comma-separated) overrides it; it is ``pp_layer_partition`` here.
"""

from __future__ import annotations

from ..spec.parallel import InferParallel
from .vllm_grid import vllm_position


def sglang_pp_indices(
    num_layers: int, pp_rank: int, pp: int, partition: tuple[int, ...] | None = None
) -> tuple[int, int]:
    """``[start, end)`` global layers of stage ``pp_rank`` of ``pp``: SGLang's
    ``get_pp_indices``. Without ``partition``, with ``b = L//P`` and ``r = L%P``::

        stage k < P - r:   [k·b, (k+1)·b)
        stage k >= P - r:  [k·(b+1) - (P-r), .. + b+1)
    """
    if partition is not None and pp > 1:  # one stage ignores the partition (SGLang's rule)
        if len(partition) != pp or sum(partition) != num_layers:
            raise ValueError(
                f"pp layer partition {list(partition)} must have pp={pp} entries summing to "
                f"num_hidden_layers={num_layers} (SGLANG_PP_LAYER_PARTITION, SGLang's rule)"
            )
        start = sum(partition[:pp_rank])
        return start, start + partition[pp_rank]
    base, extra = divmod(num_layers, pp)
    plain = pp - extra  # stages without an extra layer come first
    if pp_rank >= plain:
        start = pp_rank * (base + 1) - plain
        return start, start + base + 1
    return pp_rank * base, (pp_rank + 1) * base


def sglang_replicas(par: InferParallel, rank: int) -> tuple[int, ...]:
    """Ranks with identical pieces: the same pipeline stage, attention data-parallel rank
    (``edp``) and tensor-parallel rank in every replica. Under dp attention the ``edp``
    groups of one engine share attention and ``embed_tokens`` but every layer's MLP or
    experts are split over all ``engine_dp·tp`` ranks, so no two ranks of an engine
    match (unlike ``vllm_replicas``, no stage without experts joins them); the layer
    split does not enter."""
    me = vllm_position(par, rank)
    out = []
    for other in range(par.world_size):
        o = vllm_position(par, other)
        if (o.pp, o.edp, o.tp) == (me.pp, me.edp, me.tp):
            out.append(other)
    return tuple(out)
