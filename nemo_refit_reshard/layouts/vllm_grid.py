"""Where a vLLM inference rank sits: its coordinates in the inference world
(:class:`VllmPosition`, :func:`vllm_position`), the layers its pipeline stage builds
(:func:`vllm_pp_indices`), the experts it holds under expert parallel
(:func:`vllm_expert_range`) and the ranks that hold the same pieces
(:func:`vllm_replicas`). Ranks are numbered replica-major::

    rank = ((replica·engine_dp + edp)·pp + pp_rank)·tp + tp_rank

``replica`` is an independent engine (``dp`` on our inference side, as NeMo RL and veRL
run one engine per replica); ``edp`` is vLLM's own ``data_parallel_size`` inside an
engine. Pipeline stages follow ``get_pp_indices`` (``L//P`` layers each, the ``L%P``
extra layers to stages ``P-2, P-3, ...``); experts are placed linearly (rank m of M holds
``E//M + (m < E%M)`` whole experts from ``m·(E//M) + min(m, E%M)``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.model import ModelSpec
from ..spec.parallel import InferParallel
from .vllm_releases import VllmOptions


@dataclass(frozen=True)
class VllmPosition:
    """One rank's coordinates: engine ``replica``, vLLM data-parallel rank ``edp`` inside
    it, pipeline stage ``pp`` and tensor-parallel rank ``tp``."""

    replica: int
    edp: int
    pp: int
    tp: int

    def as_dict(self) -> dict[str, int]:
        return dict(dp=self.replica, engine_dp=self.edp, pp=self.pp, tp=self.tp)


def vllm_position(par: InferParallel, rank: int) -> VllmPosition:
    """Inverse of the replica-major numbering above; ``ValueError`` outside the world."""
    if not 0 <= rank < par.world_size:
        raise ValueError(f"rank {rank} outside the inference world of {par.world_size} ({par})")
    tp = rank % par.tp
    pp = (rank // par.tp) % par.pp
    edp = (rank // (par.tp * par.pp)) % par.engine_dp
    return VllmPosition(replica=rank // par.engine_world_size, edp=edp, pp=pp, tp=tp)


def vllm_pp_indices(
    num_layers: int, pp_rank: int, pp: int, partition: tuple[int, ...] | None = None
) -> tuple[int, int]:
    """``[start, end)`` global layers of stage ``pp_rank`` (vLLM ``get_pp_indices``)."""
    if partition is not None:
        if len(partition) != pp or sum(partition) != num_layers:
            raise ValueError(
                f"pp layer partition {list(partition)} must have pp={pp} entries summing to "
                f"num_layers={num_layers}"
            )
        parts = list(partition)
    else:
        parts = [num_layers // pp] * pp
        for i in range(2, num_layers % pp + 2):
            parts[-i] += 1
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


def vllm_expert_range(num_experts: int, ep: int, ep_rank: int) -> tuple[int, int]:
    """Linear placement: ``[start, start + count)`` global experts of ``ep_rank``."""
    base, rem = divmod(num_experts, ep)
    start = ep_rank * base + min(ep_rank, rem)
    return start, start + base + (1 if ep_rank < rem else 0)


def vllm_replicas(
    spec: ModelSpec, par: InferParallel, rank: int, opts: VllmOptions
) -> tuple[int, ...]:
    """Ranks with identical pieces: same pp and tp, and same edp when the stage has experts."""
    me = vllm_position(par, rank)
    start, end = vllm_pp_indices(spec.arch.num_layers, me.pp, par.pp, opts.pp_layer_partition)
    has_experts = any(spec.arch.is_sparse(layer) for layer in range(start, end))
    out = []
    for other in range(par.world_size):
        o = vllm_position(par, other)
        if (o.pp, o.tp) != (me.pp, me.tp):
            continue
        if has_experts and o.edp != me.edp:
            continue
        out.append(other)
    return tuple(out)
