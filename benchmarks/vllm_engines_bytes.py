"""vLLM's weight-transfer engines side by side with ``reshard``: bytes and staging memory.

    .venv-vllm/bin/python benchmarks/vllm_engines_bytes.py            # the table
    python benchmarks/vllm_engines_bytes.py   # re-runs itself under .venv-vllm

Per case (a model, Megatron's layout, vLLM's layout), bf16 both sides, and per engine:

- **worker receives** — bytes each vLLM worker receives in one refit (max over workers;
  the total over all workers in the next column);
- **trainer gathers** — bytes the training ranks must move among themselves before they
  can serve (full tensors materialized on ranks that did not hold them), summed over
  training ranks;
- **peak staging** — transfer buffers one rank holds at once (worker side / trainer side).

What is vLLM's own code and what is reproduced:

- ``nccl_m2n``: which parameters resolve *direct* (each worker receives its shard) and
  which take the full-tensor *fallback* is vLLM's ``m2n_layout.resolve_parameter_
  destinations`` run on vLLM's own model class for each rank (meta device), with the
  arguments ``m2n_engine._prepare_destination_plan`` passes it. The trainer's source
  layouts are checked with vLLM's ``m2n_common.check_plan_limits`` /
  ``validate_layout``; choosing them (the rule in :func:`m2n_source`) is ours.
- ``sharded_rdt``: the op chains are baked by vLLM's own
  ``ShardedRDTWeightTransferEngine._bake`` (its ``FakeRDTTensor`` / ``BakeSink``
  recording through the model's own ``load_weights``) on the meta device; each worker's
  pull is the distinct ``FetchKey`` slices of that bake, sized as
  ``_build_call_plan`` sizes them; its ring slot is vLLM's ``buffer_alloc_bytes``.
- ``nccl``: every worker receives every tensor (``nccl_engine.receive_weights``); packed
  chunks follow ``packed_tensor.pack_tensors`` (reproduced: it needs CUDA streams).
- ``reshard``: our plan (``plan_refit``); staging from its per-round traffic.

vLLM's rank builds use symmetry: inference replicas (vLLM ``dp``) are identical, so one
rank per TP position is built; and layers of one kind are identical, so vLLM's model is
built with one layer per kind (DeepSeek-V3: its 3 dense layers + 1 MoE layer; the
others: 1 layer) and every checkpoint name of layer ``L`` is counted as its
representative layer's. Our plan is built at full depth, all ranks.

This file is the command line and the table; each engine's figures are in
``benchmarks/vllm_engines/`` (``common.py``: the case every engine reads; ``reshard.py``,
``nccl.py``, ``m2n.py``, ``sharded_rdt.py``: one engine each).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.vllm_engines.common import Figures

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

# (model preset, Megatron, vLLM, Megatron's first/last stage layers): the common
# layouts the table reports (DeepSeek-V3's 61 layers at pp=16: 3 + 14 x 4 + 2, the
# published split, as benchmarks/published.py).
CASES = [
    ("qwen3-8b", "tp=4,pp=2,dp=2", "tp=2,dp=4", None),
    ("qwen3-30b-a3b", "pp=2,dp=8,ep=8", "tp=8,dp=2", None),
    ("deepseek-v3", "pp=16,dp=16,ep=16", "tp=32,dp=8", (3, 2)),
]


def _reexec_under_vllm_venv() -> None:
    """Run under ``.venv-vllm`` (vLLM's model classes, CPU torch) if vLLM is not here."""
    if importlib.util.find_spec("vllm") is not None:
        return
    if not VENV_PYTHON.exists():
        sys.exit(f"vLLM is not installed here and {VENV_PYTHON} is missing")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    os.execve(str(VENV_PYTHON), [str(VENV_PYTHON), *sys.argv], env)


def run_case(
    model_name: str,
    train_text: str,
    infer_text: str,
    stages: tuple[int, int] | None = None,
) -> dict[str, Figures]:
    """Every engine's figures for one case, in the table's order, each noted with its
    workers' total over ``min_bytes``; prints the case's sizes and timings as a comment."""
    from benchmarks.vllm_engines.common import build_case
    from benchmarks.vllm_engines.m2n import m2n_resolve_ranks, nccl_m2n_figures
    from benchmarks.vllm_engines.nccl import nccl_figures
    from benchmarks.vllm_engines.reshard import reshard_figures
    from benchmarks.vllm_engines.sharded_rdt import rdt_bake_ranks, sharded_rdt_figures

    case = build_case(model_name, train_text, infer_text, stages)
    figures = {"reshard": reshard_figures(case), **nccl_figures(case)}

    # vLLM's own code on its model class, one worker per TP position
    t0 = time.perf_counter()
    m2n_per_pos = m2n_resolve_ranks(case)
    rdt_per_pos, unbaked = rdt_bake_ranks(case)
    t_vllm = time.perf_counter() - t0
    figures["nccl_m2n"] = nccl_m2n_figures(case, m2n_per_pos)
    figures["sharded_rdt"] = sharded_rdt_figures(case, rdt_per_pos, unbaked)

    minimum = case.plan.stats.min_bytes
    for f in figures.values():
        f.notes.insert(0, f"{f.worker_total / minimum:.2f}x min")
    print(
        f"<!-- {model_name}: {train_text} -> {infer_text}: T={case.num_sources}, "
        f"N={case.num_workers}, min {gib(minimum)}, {len(case.tensors):,} tensors, dropped "
        f"(no vLLM rank stores them) {len(case.dropped)}; our plan {case.plan_seconds:.0f} s, "
        f"vLLM builds+bakes {t_vllm:.0f} s ({case.infer.tp} ranks, {case.keep} layer(s)) -->",
        flush=True,
    )
    return figures


def gib(n: int | None) -> str:
    if n is None:
        return "needs a GPU"
    return f"{n / 2**30:,.2f} GiB"


def main() -> None:
    import logging

    logging.getLogger("vllm").setLevel(logging.WARNING)
    which = sys.argv[1:] or [c[0] for c in CASES]
    print(
        "| model | training → inference | engine | worker receives (max) | "
        "all workers | trainer gathers | staging: worker | staging: trainer | notes |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for model, train, infer, stages in CASES:
        if model not in which:
            continue
        figs = run_case(model, train, infer, stages)
        first = True
        for engine, f in figs.items():
            head = f"| {model} | {train} → {infer} " if first else "| | "
            first = False
            print(
                f"{head}| `{engine}` | {gib(f.worker_max)} | {gib(f.worker_total)} | "
                f"{gib(f.trainer_gather)} | {gib(f.worker_staging)} | "
                f"{gib(f.trainer_staging)} | {'; '.join(f.notes)} |",
                flush=True,
            )


if __name__ == "__main__":
    _reexec_under_vllm_venv()
    sys.path.insert(0, str(ROOT))  # tests.helpers.vllm_cpu builds vLLM's ranks
    main()
