"""Megatron-core's parallel grid and pipeline layer split (megatron-core 0.16).

Rank order follows ``RankGenerator`` with the default ``order="tp-cp-ep-dp-pp"``
(``parallel_state.initialize_model_parallel``), ``tp`` innermost. The dense grid
has no ``ep`` axis (size 1); the expert grid is ``etp-ep-edp-pp`` over the same
ranks::

    rank = tp + T·(cp + CP·(dp + DP·pp))
    rank = etp + ETP·(ep + EP·(edp + EDP·pp))

Layer split: ``get_num_layers_to_build`` / ``get_transformer_layer_offset``
(transformer_block.py / transformer_layer.py), including
``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``
and virtual pipeline chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.parallel import TrainParallel


@dataclass(frozen=True)
class MegatronPosition:
    """One rank's coordinates in the dense and the expert grid."""

    tp: int
    cp: int
    dp: int
    pp: int
    etp: int
    ep: int
    edp: int

    def as_dict(self) -> dict[str, int]:
        return dict(
            tp=self.tp, cp=self.cp, dp=self.dp, pp=self.pp, etp=self.etp, ep=self.ep, edp=self.edp
        )


def megatron_position(par: TrainParallel, rank: int) -> MegatronPosition:
    if not 0 <= rank < par.world_size:
        raise ValueError(f"rank {rank} outside the training world of {par.world_size} ({par})")
    stage_size = par.tp * par.cp * par.dp
    pp, inner = divmod(rank, stage_size)
    tp = inner % par.tp
    cp = (inner // par.tp) % par.cp
    dp = inner // (par.tp * par.cp)
    etp = inner % par.expert_tp
    ep = (inner // par.expert_tp) % par.ep
    edp = inner // (par.expert_tp * par.ep)
    return MegatronPosition(tp=tp, cp=cp, dp=dp, pp=pp, etp=etp, ep=ep, edp=edp)


def megatron_replicas(par: TrainParallel, rank: int, has_experts: bool) -> tuple[int, ...]:
    """Ranks holding exactly the same pieces as ``rank``: same pp and tp (and etp, ep)."""
    me = megatron_position(par, rank)
    out = []
    for other in range(par.world_size):
        o = megatron_position(par, other)
        if (o.pp, o.tp) != (me.pp, me.tp):
            continue
        if has_experts and (o.etp, o.ep) != (me.etp, me.ep):
            continue
        out.append(other)
    return tuple(out)


def megatron_layer_chunks(
    num_layers: int,
    par: TrainParallel,
    pp_rank: int,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list[tuple[int, int]]:
    """``(first global layer, layer count)`` of each virtual chunk on pipeline stage ``pp_rank``."""
    pp, vpp = par.pp, par.vpp
    if pp == 1:
        if first_stage_layers is not None or last_stage_layers is not None:
            raise ValueError("num_layers_in_first/last_pipeline_stage need pp > 1")
        return [(0, num_layers)]
    uneven = first_stage_layers is not None or last_stage_layers is not None
    if uneven:
        first = first_stage_layers or 0
        last = last_stage_layers or 0
        middle_stages = pp - (first_stage_layers is not None) - (last_stage_layers is not None)
        middle_layers = num_layers - first - last
        if middle_layers < 0 or (middle_stages == 0 and middle_layers != 0):
            raise ValueError(
                f"num_layers_in_first/last_pipeline_stage ({first_stage_layers}, "
                f"{last_stage_layers}) do not fit num_layers={num_layers} over pp={pp}"
            )
        if middle_stages and middle_layers % middle_stages:
            raise ValueError(
                f"uneven pipeline: the {middle_layers} layers left after the first/last stages "
                f"must divide evenly over the {middle_stages} middle stages (Megatron's rule); "
                "change num_layers_in_first/last_pipeline_stage"
            )
        per_middle = middle_layers // middle_stages if middle_stages else 0
        counts = [per_middle] * pp
        if first_stage_layers is not None:
            counts[0] = first_stage_layers
        if last_stage_layers is not None:
            counts[-1] = last_stage_layers
        for stage, count in enumerate(counts):
            if count % vpp:
                raise ValueError(
                    f"pipeline stage {stage} has {count} layers, not divisible by vpp={vpp}"
                )
        # Chunk c of every stage comes before chunk c+1 of any stage.
        per_chunk = [count // vpp for count in counts]
        chunk_total = sum(per_chunk)
        before = sum(per_chunk[:pp_rank])
        return [(c * chunk_total + before, per_chunk[pp_rank]) for c in range(vpp)]
    if num_layers % pp:
        raise ValueError(
            f"num_layers={num_layers} is not divisible by pp={pp} (Megatron's rule); choose a pp "
            "that divides it or set num_layers_in_first/last_pipeline_stage"
        )
    per_stage = num_layers // pp
    if per_stage % vpp:
        raise ValueError(
            f"{per_stage} layers per pipeline stage are not divisible by vpp={vpp} "
            "(Megatron's rule for virtual pipeline chunks)"
        )
    per_chunk = per_stage // vpp
    return [(c * (num_layers // vpp) + pp_rank * per_chunk, per_chunk) for c in range(vpp)]
