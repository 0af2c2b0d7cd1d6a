"""Where an SGLang 0.5.23 inference rank sits: the layers its pipeline stage builds
(:func:`sglang_pp_indices`) and the ranks that hold the same pieces
(:func:`sglang_replicas`). Ranks are numbered as vLLM's are (``vllm_grid.vllm_position``)
with ``engine_dp`` = 1::

    rank = (replica·pp + pp_rank)·tp + tp_rank

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
    """Ranks with identical pieces: the same pipeline stage and tensor-parallel rank in
    every replica. SGLang's engine-internal data parallelism is refused
    (``check_sglang_parallel``), so unlike ``vllm_replicas`` no stage's experts tell
    replicas apart and the layer split does not enter."""
    me = vllm_position(par, rank)
    out = []
    for other in range(par.world_size):
        o = vllm_position(par, other)
        if (o.pp, o.tp) == (me.pp, me.tp):
            out.append(other)
    return tuple(out)
