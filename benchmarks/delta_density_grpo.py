"""BF16 update density of the CPU GRPO app: changed fraction per GRPO step and tensor class.

``benchmarks/delta_density.py`` measures it on a language-model pretraining loop; this runs
the app itself (``nemo_refit_reshard/grpo_cpu``: Megatron tp training actors, vLLM-layout
generation replicas, real GRPO steps between refits on Ray) with delta refit on, and after
every refit reads the training actors' live parameters back (``trainer_canonical``: each
element once, TP shards reassembled, replicated norms counted once). The app does not
change: the probe is its ``after_refit`` hook, the bytes come from its step report.

An element of a parameter *changed* in step s when its BF16 bits differ from step s-1's:

    changed(x_prev, x) = #{ i : bits16(bf16(x_prev[i])) != bits16(bf16(x[i])) }

(``bits16`` = ``view(torch.int16)``), not float inequality: ``-0.0 -> 0.0`` is a change,
``NaN -> NaN`` with equal bits is none, and an FP32 update smaller than half a BF16 ulp is
none either. The trainer keeps its parameters in float32 (Adam on them, as the masters of a
mixed-precision run); bf16() is the cast the refit puts on the wire (``infer.dtype
bfloat16``), so the BF16 fraction is what a delta refit must send. The FP32 column counts
the same over the float32 bits. Classes by the Megatron parameter name, with
``delta_density.py``'s classifier (attention, mlp, embeddings, norms, router; the input
embedding and output layer also apart).

    python3 benchmarks/delta_density_grpo.py --lr 1e-6 3e-6 2e-3 --steps 20 [--json out.json]
    python3 benchmarks/delta_density_grpo.py --lr 1e-3 --steps 2 --set grpo.prompts_per_step=4

``--set key=value`` are Hydra overrides of ``configs/grpo_cpu.yaml`` (the app's config);
``refit.delta=true refit.compare_broadcast=false infer.dtype=bfloat16 progress=false`` and
the ``grpo.lr`` / ``grpo.num_steps`` of the run are always added.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from delta_density import (  # noqa: E402  (benchmarks/ has no package)
    COLUMNS,
    PARTS,
    fractions,
    git_commit,
    median_after_first,
    tensor_class,
)

from nemo_refit_reshard.grpo_cpu.config import GrpoRunConfig  # noqa: E402
from nemo_refit_reshard.grpo_cpu.driver import RefitEvent, run_grpo  # noqa: E402
from nemo_refit_reshard.grpo_cpu.report import StepReport  # noqa: E402
from nemo_refit_reshard.integrations.hydra_config import load_config  # noqa: E402

FIXED = ["refit.delta=true", "refit.compare_broadcast=false", "infer.dtype=bfloat16"]
INT_OF = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def bits_changed(before: torch.Tensor, after: torch.Tensor, dtype: torch.dtype) -> int:
    """Elements whose bits in ``dtype`` differ: #{i : bits(cast(before)[i]) != bits(...)}."""
    if before.shape != after.shape:
        raise ValueError(f"shapes differ: {tuple(before.shape)} vs {tuple(after.shape)}")
    ints = INT_OF[dtype]
    return int((before.to(dtype).view(ints) != after.to(dtype).view(ints)).sum())


class DensityProbe:
    """``after_refit`` hook: per refit, changed elements per Megatron parameter name.

    Canonical (HF) tensors are grouped under the Megatron parameter that holds them (q, k
    and v under ``linear_qkv``, gate and up under ``linear_fc1``), from the training
    actors' layouts, so ``delta_density.tensor_class`` and ``fractions`` apply as they are.
    """

    def __init__(self) -> None:
        self.previous: dict[str, torch.Tensor] | None = None
        self.megatron: dict[str, str] = {}  # canonical name -> Megatron parameter name
        self.tensors: dict[str, dict[str, Any]] = {}  # Megatron name -> cls, numel
        self.steps: dict[int, dict[str, Any]] = {}
        self.last_step = -1

    def __call__(self, event: RefitEvent) -> None:
        if event.step <= self.last_step:  # a second backend's refit of the same weights
            return
        self.last_step = event.step
        now = event.cluster.trainer_canonical()
        if not self.megatron:
            for layout in event.cluster.sources:
                for t in layout.tensors:
                    for p in t.pieces:
                        self.megatron[p.canonical] = t.name
            for name, value in now.items():
                meg = self.megatron[name]
                entry = self.tensors.setdefault(meg, {"cls": tensor_class(meg), "numel": 0})
                entry["numel"] += value.numel()
        if self.previous is not None:
            bf16 = dict.fromkeys(self.tensors, 0)
            fp32 = 0
            for name, value in now.items():
                bf16[self.megatron[name]] += bits_changed(
                    self.previous[name], value, torch.bfloat16
                )
                fp32 += bits_changed(self.previous[name], value, torch.float32)
            self.steps[event.step] = {
                "changed": bf16,
                "fraction": fractions(bf16, self.tensors),
                "fp32_fraction": fp32 / sum(t["numel"] for t in self.tensors.values()),
            }
        self.previous = now


def run_config(lr: float, steps: int, overrides: list[str]) -> GrpoRunConfig:
    extra = FIXED + ["progress=false", f"grpo.lr={lr}", f"grpo.num_steps={steps}"]
    return GrpoRunConfig.from_dict(load_config(ROOT / "configs", "grpo_cpu", overrides + extra))


def run(lr: float, steps: int, overrides: list[str]) -> dict[str, Any]:
    """One app run at ``lr``; per step: fractions, trainer metrics and delta bytes."""
    cfg = run_config(lr, steps, overrides)
    probe = DensityProbe()
    reports: list[StepReport] = []
    t0 = time.perf_counter()
    run_grpo(cfg, after_refit=probe, on_step=reports.append)
    rows = []
    for r in reports:
        sent, dense = r.delta_bytes if r.delta_bytes is not None else (None, None)
        rows.append(
            dict(
                step=r.step,
                reward=r.reward,
                loss=r.metrics.get("loss"),
                grad_norm=r.metrics.get("grad_norm"),
                seconds=r.seconds,
                delta_sent_bytes=sent,
                delta_dense_bytes=dense,
                **probe.steps[r.step],
            )
        )
    return dict(lr=lr, seconds=time.perf_counter() - t0, tensors=probe.tensors, steps=rows)


def _kib(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024:.0f}"


def markdown(result: dict[str, Any]) -> str:
    """Per-step table per lr, then the median after step 1 per class and lr."""
    lines = []
    for r in result["runs"]:
        cols = [c for c in r["steps"][0]["fraction"] if c not in dict(PARTS)]
        lines += [
            f"lr = {r['lr']:g} ({r['seconds']:.0f} s):",
            "",
            "| step | reward | grad norm | "
            + " | ".join(cols)
            + " | FP32 | delta sent / dense KiB |",
            "|---:|---:|---:|" + "---:|" * (len(cols) + 2),
        ]
        for s in r["steps"]:
            cells = [f"{100 * s['fraction'][c]:.3f} %" for c in cols]
            lines.append(
                f"| {s['step']} | {s['reward']:.3f} | {s['grad_norm']:.3f} | "
                + " | ".join(cells)
                + f" | {100 * s['fp32_fraction']:.1f} % | "
                + f"{_kib(s['delta_sent_bytes'])} / {_kib(s['delta_dense_bytes'])} |"
            )
        lines.append("")
    cols = list(result["runs"][0]["steps"][0]["fraction"])
    lines += [
        f"Median changed fraction over steps 2..{result['args']['steps']}:",
        "",
        "| lr | " + " | ".join(cols) + " | delta sent / dense |",
        "|---:|" + "---:|" * (len(cols) + 1),
    ]
    for r in result["runs"]:
        cells = [f"{100 * median_after_first(r, c):.3f} %" for c in cols]
        later = r["steps"][1:] or r["steps"]
        ratios = [
            s["delta_sent_bytes"] / s["delta_dense_bytes"] for s in later if s["delta_dense_bytes"]
        ]
        ratio = f"{sorted(ratios)[len(ratios) // 2]:.3f}" if ratios else "-"
        lines.append(f"| {r['lr']:g} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-6, 3e-6, 2e-3])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="configs/grpo_cpu.yaml overrides"
    )
    ap.add_argument("--json", metavar="PATH", help="write the full result here ('-': stdout)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    commit = git_commit()
    import ray

    cfg = run_config(args.lr[0], args.steps, args.set)  # config errors before Ray starts
    ray.init(
        num_cpus=cfg.ray.num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="WARNING",
    )
    try:  # one Ray for every lr (run_grpo reuses a running one)
        runs = [run(lr, args.steps, args.set) for lr in args.lr]
    finally:
        ray.shutdown()
    result = dict(
        args=vars(args),
        commit=commit,
        columns=list(COLUMNS),
        versions=dict(python=sys.version.split()[0], torch=torch.__version__, ray=ray.__version__),
        runs=runs,
    )
    if args.json == "-":
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        print(markdown(result))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
