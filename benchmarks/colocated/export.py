"""Megatron-Bridge's HF export, per training rank, from our Megatron layouts.

Both other systems start from it: NeMo RL's ``MegatronPolicyWorker.
_iter_params_with_optional_kv_scales`` calls ``AutoBridge.export_hf_weights`` (``cpu=False``),
and vLLM's ``ipc`` engine needs a ``WeightSource.iter_full`` that yields every full tensor
on every rank, which for a Megatron trainer is this same export.

Megatron-Bridge ``models/conversion/model_bridge.py``, ``stream_weights_megatron_to_hf``
("All ranks receive the full tensors"): one task per Megatron parameter of every pipeline
stage (this rank's local experts only), each through its mapping
(``models/conversion/param_mapping.py``):

* ``broadcast_from_pp_rank``: off the owning stage, the owner's shard arrives (``S``
  bytes) into a fresh tensor;
* ``gather_from_tp_ranks`` (Column/Row/QKV/GatedMLP mappings; over the expert-TP group
  for experts): ``all_gather`` of ``T`` shards, then ``torch.cat`` (a ``T·S`` copy;
  GatedMLP: chunk each shard, cat gates and ups);
* ``QKVMapping``: ``split_qkv_weights`` indexes q, k, v out of the packed tensor (a
  ``T·S`` copy, also at ``T = 1``);
* ``gather_from_ep_ranks`` (experts): ``all_gather`` of the TP-full expert over EP, so
  every rank yields all ``E`` experts;
* replicated parameters (norms, router) and unsharded ones are yielded as views.

Not counted: NCCL's own writes of a rank's own slot and PyTorch's flat staging of
``all_gather`` into a list (ProcessGroupNCCL internals), so the copies and buffers here
are lower bounds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from benchmarks.colocated.common import Case, itemsize
from nemo_refit_reshard.layouts import LocalTensor, RankLayout
from nemo_refit_reshard.spec import TrainParallel
from nemo_refit_reshard.spec.model import ModelSpec

_EXPERT = re.compile(r"experts\.(\d+)\.")


def is_expert(megatron_name: str) -> bool:
    """Bridge's ``MegatronParamMapping.is_expert``."""
    return ".experts.linear_fc" in megatron_name or ".experts.local_experts." in megatron_name


@dataclass
class Export:
    """One training rank's export, bytes. ``stream``: every yielded HF tensor in order,
    ``(name, bytes)``."""

    received: int = 0  # over the interconnect: PP broadcasts, TP and EP all-gathers
    copies: int = 0  # torch-level device copies (cat after TP gathers, QKV split)
    materialized: int = 0  # full HF tensors it did not hold whole
    held_new: int = 0  # storage of every yielded tensor that is new memory
    peak_transient: int = 0  # most bytes one task holds at once (its yields included)
    peak_unpacked: int = 0  # most bytes alive if every yielded tensor is kept (vLLM ipc)
    stream: list[tuple[str, int]] = field(default_factory=list)


def _stage_layouts(case: Case, rank: int) -> list[RankLayout]:
    """The layouts of ``rank``'s pipeline group (same tp, cp, dp), by stage."""

    def column(layout: RankLayout) -> tuple[int, int, int]:
        return layout.position["tp"], layout.position["cp"], layout.position["dp"]

    group = [s for s in case.sources if column(s) == column(case.sources[rank])]
    return sorted(group, key=lambda s: s.position["pp"])


def _expert_names(name: str, ep: int, experts: int) -> list[str]:
    """The names ``gather_from_ep_ranks`` yields for a local expert's HF name."""
    per_rank = experts // ep
    local = int(_EXPERT.search(name).group(1)) % per_rank  # type: ignore[union-attr]
    return [_EXPERT.sub(f"experts.{local + k * per_rank}.", name) for k in range(ep)]


def export(case: Case, rank: int) -> Export:
    """What ``rank``'s export gathers, copies, materializes and holds (module docstring)."""
    par, spec = case.train, case.spec
    my_stage = case.sources[rank].position["pp"]
    out, seen, held = Export(), set(), 0
    for layout in _stage_layouts(case, rank):
        own = layout.position["pp"] == my_stage
        for t in layout.tensors:
            names = list(dict.fromkeys(p.canonical for p in t.pieces))
            if not names or all(n in seen for n in names):
                continue  # a tied/duplicated weight is exported once (first owner)
            seen.update(names)
            held = _task(out, t, names, own, par, spec, held)
    out.held_new = held
    return out


def _task(out: Export, t: LocalTensor, names: list[str], own: bool, par: TrainParallel,
          spec: ModelSpec, held: int) -> int:  # fmt: skip
    """Account one conversion task into ``out``; returns the new-memory bytes held so far
    by the yielded tensors (vLLM ipc's unpacked mode keeps all of them)."""
    size = itemsize(t.dtype)
    shard = t.numel * size
    expert = is_expert(t.name)
    partial = any(p.canonical_box.numel != spec.tensor(p.canonical).numel for p in t.pieces)
    tp_size = (par.expert_tp if expert else par.tp) if partial else 1
    ep = par.ep if expert and par.ep > 1 else 1
    experts = spec.arch.moe.num_experts if ep > 1 else 0  # type: ignore[union-attr]
    qkv = t.name.endswith(("linear_qkv.weight", "linear_qkv.bias"))
    bcast = 0 if own else shard
    full = tp_size * shard
    out.received += bcast + (tp_size - 1) * shard + (ep - 1) * full
    out.copies += (full if tp_size > 1 else 0) + (full if qkv else 0)
    fresh = not own or tp_size > 1 or ep > 1
    yields = []
    for n in names:
        for name in _expert_names(n, ep, experts) if ep > 1 else [n]:
            yields.append((name, spec.tensor(n).numel * size))
    out.stream += yields
    hf_bytes = sum(b for _, b in yields)
    if fresh:
        out.materialized += hf_bytes
    # bytes alive at the task's peak: the broadcast copy, then either the TP gather list
    # plus its cat (or the QKV split), or the TP-full tensor plus the EP gather outputs
    tp_peak = bcast + (2 * full if tp_size > 1 else (shard if qkv else 0))
    ep_peak = bcast + (full if tp_size > 1 else 0) + ep * full if ep > 1 else 0
    transient = max(tp_peak, ep_peak)
    new = full * ep if fresh else (shard if qkv else 0)  # storage behind the yields
    out.peak_transient = max(out.peak_transient, transient)
    out.peak_unpacked = max(out.peak_unpacked, held + transient)
    return held + new
