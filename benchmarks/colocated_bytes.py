"""Colocated refits side by side: bytes and memory per GPU.

    python3 benchmarks/colocated_bytes.py              # every case, a markdown table
    python3 benchmarks/colocated_bytes.py qwen3-8b     # the cases of one model

Every GPU hosts one Megatron training rank and one vLLM worker (inference rank ``d`` on
training rank ``d``'s GPU), bf16 both sides, layouts from
``nemo_refit_reshard.runner.build_layouts``. Per system, per case:

- **interconnect** — bytes received over the interconnect (NVLink/network) in one refit:
  all GPUs, and the most one GPU receives;
- **copied** — bytes written by device copies on one GPU (training process and vLLM
  worker together; bytes landing from the interconnect not counted), the most any GPU;
- **materialized** — full HF tensors one GPU builds that it did not hold whole;
- **extra memory** — the peak memory one GPU holds beyond both sides' live weights.

Systems (each module's docstring cites the code its figures come from):

- ``reshard-colocated`` (``benchmarks/colocated/ours.py``): our plan
  (``plan_refit(..., colocation=Colocation.same_index(S, D))``), each GPU's host and
  guest programs compiled (``RankProgram``, meta tensors) as ``engine/colocated.py`` runs.
- NeMo RL (``benchmarks/colocated/nemo_rl.py``): its colocated ZMQ/CUDA-IPC refit over
  the Megatron-Bridge export (``benchmarks/colocated/export.py``).
- vLLM 0.33 ``ipc`` (``benchmarks/colocated/vllm_ipc.py``), unpacked (its default) and
  packed, fed by the same export (the only way these Megatron layouts give every rank
  every full tensor, which its trainer side requires).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.colocated.common import Case, Figures, build_case  # noqa: E402
from benchmarks.colocated.nemo_rl import nemo_rl_figures  # noqa: E402
from benchmarks.colocated.ours import ours_figures  # noqa: E402
from benchmarks.colocated.vllm_ipc import vllm_ipc_figures  # noqa: E402

# (model preset, Megatron, vLLM): 8 GPUs each. Qwen3-30B-A3B: etp defaults to tp (2, as
# in megatron-core), so etp·ep = 8 = tp·dp (Megatron's rule; edp = 1); NeMo RL's
# grpo_math_qwen30ba3b_megatron.yaml sets etp=1 (edp = 2), the second row. DeepSeek-V3 on
# 256 GPUs is left out: its colocated plan alone takes ~160 s here (every destination is
# planned on its own), ~225 s with the layouts and traffic.
CASES = [
    ("qwen3-8b", "tp=2,dp=4", "tp=1,dp=8"),
    ("qwen3-8b", "tp=4,dp=2", "tp=2,dp=4"),
    ("qwen3-30b-a3b", "tp=2,ep=4,dp=4", "tp=4,dp=2"),
    ("qwen3-30b-a3b", "tp=2,ep=4,etp=1,dp=4", "tp=4,dp=2"),
]
SYSTEMS = ["reshard-colocated", "NeMo RL (ZMQ + CUDA IPC)", "vLLM `ipc`", "vLLM `ipc` packed"]


def run_case(model: str, train: str, infer: str) -> tuple[Case, dict[str, Figures]]:
    """Every system's figures for one case, in :data:`SYSTEMS` order."""
    case = build_case(model, train, infer)
    figures = {
        SYSTEMS[0]: ours_figures(case),
        SYSTEMS[1]: nemo_rl_figures(case),
        SYSTEMS[2]: vllm_ipc_figures(case, packed=False),
        SYSTEMS[3]: vllm_ipc_figures(case, packed=True),
    }
    return case, figures


def gib(n: int | None) -> str:
    return "needs a GPU" if n is None else f"{n / 2**30:,.2f}"


def extra_cell(f: Figures) -> str:
    return (
        f"{gib(f.extra_max)} + {f.extra_runtime} (needs a GPU)"
        if f.extra_runtime
        else gib(f.extra_max)
    )


def main(argv: list[str]) -> None:
    which = argv or sorted({c[0] for c in CASES})
    print(
        "| model | training → inference (GPUs) | system | interconnect, all GPUs | "
        "interconnect, max per GPU | copied, max per GPU | materialized, max per GPU | "
        "extra memory, max per GPU | notes |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for model, train, infer in CASES:
        if model not in which:
            continue
        t0 = time.perf_counter()
        case, figures = run_case(model, train, infer)
        first = True
        for system, f in figures.items():
            head = f"| {model} | {train} → {infer} ({case.num_gpus}) " if first else "| | "
            first = False
            print(
                f"{head}| {system} | {gib(f.net_total)} | {gib(f.net_max)} | "
                f"{gib(f.copied_max)} | {gib(f.materialized_max)} | {extra_cell(f)} | "
                f"{'; '.join(f.notes)} |",
                flush=True,
            )
        print(
            f"<!-- {model} {train} -> {infer}: min_bytes {gib(case.plan.stats.min_bytes)} GiB, "
            f"plan {case.plan_seconds:.1f} s, case {time.perf_counter() - t0:.1f} s -->",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
