"""Measured update density: how many BF16 weights a real Megatron Adam step changes.

Delta refit (docs/benchmarks.md, issue 42) sends only the BF16 elements whose bits changed
since the last refit; its gain is set by the density ``d = changed / elements`` per step.
This trains a small Qwen3-shaped megatron-core ``GPTModel`` (local layer spec, RMSNorm,
qk-layernorm, GQA, SwiGLU, untied embeddings; ``--moe``: every MLP a 4-expert top-2 MoE
with a router) with Megatron's own mixed-precision machinery, exactly as Megatron-LM
keeps it:

* parameters in BF16 (``params_dtype=bfloat16``, wrapped in ``Float16Module``), gradients
  accumulated in FP32 ``main_grad`` buffers (``DistributedDataParallel``,
  ``grad_reduce_in_fp32``), ``finalize_model_grads`` through the pipeline schedule;
* ``get_megatron_optimizer(OptimizerConfig(optimizer="adam", bf16=True, ...))``: a
  ``Float16OptimizerWithFloat16Params`` holding FP32 master copies; each step clips the
  FP32 gradient to global norm ``clip_grad`` and runs decoupled AdamW on the masters::

      m_t = β1·m + (1-β1)·g,  v_t = β2·v + (1-β2)·g²
      master_t = master·(1 - lr·wd) - lr·(m_t/(1-β1^t)) / (sqrt(v_t/(1-β2^t)) + ε)
      param_t  = bf16(master_t)             (round to nearest even)

  with lr and weight decay set per group by ``OptimizerParamScheduler`` (constant lr, no
  weight decay on norms). Every step checks both lines: the masters equal the AdamW formula
  above recomputed from the optimizer's own ``m``, ``v`` and clipped gradient, and every
  BF16 parameter is bit-for-bit the BF16 cast of its master.

A BF16 weight changes only when its master crosses a rounding boundary; Adam moves each
master by at most about ``lr`` per step and BF16 spacing near w is
``2^(floor(log2|w|)-7)``, so ``d`` is about the mean over the weights of
``min(1, |step| / spacing(w))``: small weights change most, norm weights (1.0) least.
After every step each parameter's bits (``view(int16)``) are compared with its bits before
the step; the table gives the changed fraction overall and per class.

Text: the Python language/library reference shipped with CPython (``pydoc_data.topics``)
followed by the standard library's own top-level sources, tokenized by a byte-level BPE
trained here on that text (``tokenizers``; ``--tokenizer byte`` for raw bytes). Batches
are random windows of the token stream (seeded); the model, data and order are the same
for every ``--lr``. ``--moe``: ``moe_ffn_hidden_size = ffn/2``, SequentialMLP experts,
the allgather dispatcher and the aux-loss load balancing (coefficient 1e-3) of Qwen3-MoE.

CPU patches (megatron-core 0.16.1 without CUDA, TE or Apex), besides
``integrations/megatron/cpu.apply_cpu_patches`` (RNG, ``current_device``, schedules):

* O1, only while the optimizer is built and steps: ``Tensor.type()`` names a CPU tensor
  as its ``torch.cuda.*`` type. ``Float16OptimizerWithFloat16Params`` sorts parameters by
  ``param.type() in ['torch.cuda.BFloat16Tensor', ...]`` (TypeError otherwise) and
  ``clip_grad_by_total_norm_fp32`` asserts ``grad.type() == 'torch.cuda.FloatTensor'``.
* O2: ``torch.tensor``/``torch.zeros`` with ``device='cuda'`` allocate on the CPU in the
  modules ``megatron.core.optimizer.optimizer`` (the unit loss scale),
  ``megatron.core.optimizer.clip_grads`` and ``megatron.core.utils`` (grad-norm buffers of
  the non-Apex ``local_multi_tensor_l2_norm``). Nothing else in them changes.

Without TE/Apex, megatron-core itself picks ``torch.optim.AdamW`` (the math of Apex's
FusedAdam in adam_w_mode) and its local multi-tensor copy/scale: no patch touches the
update math.

    python3 benchmarks/delta_density.py --lr 1e-6 3e-6 --steps 20 [--moe] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nemo_refit_reshard.engine.rendezvous import free_port  # noqa: E402
from nemo_refit_reshard.integrations.megatron import cpu as megatron_cpu  # noqa: E402
from nemo_refit_reshard.integrations.megatron.live import unwrap  # noqa: E402
from nemo_refit_reshard.spec.config import ArchConfig, MoeConfig  # noqa: E402
from nemo_refit_reshard.spec.parallel import TrainParallel  # noqa: E402

# Class of a parameter by its GPTModel name; the first match wins.
CLASSES: tuple[tuple[str, str], ...] = (
    ("router", r"\.mlp\.router\."),
    ("norms", r"layernorm"),
    ("attention", r"self_attention\.linear_(qkv|proj)\."),
    ("mlp", r"linear_fc[12]\."),
    ("embeddings", r"^(embedding\.word_embeddings|output_layer)\."),
)
# Reported columns: the classes, then the two halves of "embeddings" apart (rows of the input
# embedding whose token is not in the batch get no gradient; the output layer's all do).
COLUMNS = ("attention", "mlp", "embeddings", "norms", "router")
PARTS = (("input emb", "embedding.word_embeddings."), ("output layer", "output_layer."))
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def tensor_class(name: str) -> str:
    for cls, pattern in CLASSES:
        if re.search(pattern, name):
            return cls
    raise ValueError(f"no class for parameter {name}")


# -- data -----------------------------------------------------------------------------------
def corpus(max_chars: int) -> str:
    """CPython's reference text (pydoc topics), then stdlib module sources, sorted by name."""
    from pydoc_data.topics import topics

    parts = [topics[k] for k in sorted(topics)]
    size = sum(map(len, parts))
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        if size >= max_chars:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
    return "\n\n".join(parts)[:max_chars]


def tokenize(text: str, kind: str, vocab: int) -> tuple[torch.Tensor, int]:
    """Token ids of ``text`` (int64) and the tokenizer's vocabulary size."""
    if kind == "byte":
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64), 256
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer=trainer)
    return torch.tensor(tok.encode(text).ids, dtype=torch.int64), tok.get_vocab_size()


def batches(ids: torch.Tensor, batch: int, seq: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless [batch, seq + 1] random windows of ``ids`` (the same sequence for a seed)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=gen)
        yield torch.stack([ids[s : s + seq + 1] for s in starts.tolist()])


# -- CPU patches for the optimizer (module docstring, O1/O2) -------------------------------
class _CudaTensorsOnCpu(megatron_cpu._CpuZerosTorch):
    """``torch`` for megatron's optimizer modules: ``tensor``/``zeros`` on "cuda" -> CPU."""

    @staticmethod
    def tensor(*args: Any, device: Any = None, **kw: Any) -> torch.Tensor:
        return torch.tensor(*args, device="cpu" if device == "cuda" else device, **kw)


def patch_optimizer_modules() -> None:
    """O2 (module docstring)."""
    import megatron.core.utils as mutils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer

    for module in (moptimizer, clip_grads, mutils):
        module.torch = _CudaTensorsOnCpu()


@contextlib.contextmanager
def cuda_type_names() -> Iterator[None]:
    """O1 (module docstring): ``t.type()`` of a CPU tensor says ``torch.cuda.<Type>``."""
    original = torch.Tensor.type

    def type_(self: torch.Tensor, *args: Any, **kw: Any) -> Any:
        name = original(self, *args, **kw)
        if args or kw or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


# -- model and optimizer --------------------------------------------------------------------
def arch_config(args: argparse.Namespace, vocab: int) -> ArchConfig:
    moe = None
    if args.moe:
        moe = MoeConfig(4, args.ffn // 2, tuple(range(args.layers)))
    return ArchConfig(
        family="qwen3_moe" if args.moe else "qwen3",
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        intermediate_size=args.ffn,
        vocab_size=vocab,
        qk_norm=True,
        moe=moe,
    )


def build(args: argparse.Namespace, arch: ArchConfig, lr: float) -> tuple[Any, Any, Any, Any]:
    """(DDP-wrapped BF16 model, its TransformerConfig, Megatron optimizer, lr scheduler)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    par = TrainParallel()
    model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    moe: dict[str, Any] = {}
    if arch.moe is not None:
        moe = dict(
            num_moe_experts=arch.moe.num_experts,
            moe_ffn_hidden_size=arch.moe.expert_intermediate_size,
            moe_router_topk=2,
            moe_grouped_gemm=False,  # SequentialMLP (no TE grouped GEMM on CPU)
            moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-3,
        )
    config = megatron_cpu.transformer_config(
        arch,
        par,
        norm_eps=1e-6,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        bf16=True,
        **moe,
    )
    padded = -(-arch.vocab_size // 128) * 128  # Megatron-LM's make_vocab_size_divisible_by
    (gpt,) = megatron_cpu.build_gpt(
        config, arch, par, padded, rope_theta=1e6, max_sequence_length=args.seq
    )
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    model = DistributedDataParallel(config, ddp, Float16Module(config, gpt))
    opt_config = OptimizerConfig(
        optimizer="adam",
        bf16=True,
        lr=lr,
        min_lr=lr,
        weight_decay=args.weight_decay,
        clip_grad=args.clip_grad,
    )
    with cuda_type_names():
        optimizer = get_megatron_optimizer(opt_config, [model])
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=lr,
        max_lr=lr,
        min_lr=lr,
        lr_warmup_steps=0,
        lr_decay_steps=max(args.steps, 1),
        lr_decay_style="constant",
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=max(args.steps, 1),
        wd_incr_style="constant",
    )
    # What Megatron-LM's setup_model_and_optimizer wires into the schedule.
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync
    return model, config, optimizer, scheduler


def train_step(model: Any, optimizer: Any, tokens: torch.Tensor) -> tuple[float, float]:
    """One forward/backward through Megatron's schedule and one optimizer step."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, s = tokens.shape[0], tokens.shape[1] - 1
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(s).expand(b, s)
    mask = megatron_cpu.causal_mask(s)

    def loss_fn(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = per_token.float().mean()
        return loss, {"lm loss": loss.detach()}

    def step(_data: Any, chunk: Any) -> tuple[torch.Tensor, Any]:
        return chunk(inputs, positions, mask, labels=labels), loss_fn

    model.zero_grad_buffer()
    optimizer.zero_grad()
    out = get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=None,
        model=[model],
        num_microbatches=1,
        seq_length=s,
        micro_batch_size=b,
        forward_only=False,
    )
    with cuda_type_names():
        ok, grad_norm, _ = optimizer.step()
    if not ok:
        raise RuntimeError("Megatron's optimizer skipped the step (inf/nan gradient)")
    return float(out[0]["lm loss"]), float(grad_norm)


# -- checks and measurement -----------------------------------------------------------------
class AdamCheck:
    """Snapshots each FP32 master and its Adam moments before a step; :meth:`verify` then
    recomputes the step (module docstring) from the optimizer's clipped gradient and checks
    the masters, the moments, and that every BF16 parameter is the cast of its master."""

    def __init__(self, optimizer: Any) -> None:
        self.entries = []  # (model param, master, torch param group, inner optimizer)
        for opt in optimizer.chained_optimizers:
            groups = zip(opt.float16_groups, opt.fp32_from_float16_groups)
            for (models, masters), group in zip(groups, opt.optimizer.param_groups):
                for p, master in zip(models, masters):
                    self.entries.append((p, master, group, opt.optimizer))
        self.before = [self._moments(master, inner) for _, master, _, inner in self.entries]

    @staticmethod
    def _moments(master: torch.Tensor, inner: Any) -> tuple[torch.Tensor, ...]:
        state = inner.state.get(master, {})
        zero = torch.zeros_like(master)
        m, v = state.get("exp_avg", zero), state.get("exp_avg_sq", zero)
        return master.detach().clone(), m.clone(), v.clone()

    def verify(self, step: int) -> int:
        """Raise if the step was not AdamW on the masters; return how many masters changed."""
        changed = 0
        for (p, master, group, inner), (w0, m0, v0) in zip(self.entries, self.before):
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            b1, b2 = group["betas"]
            g = master.grad
            m = b1 * m0 + (1 - b1) * g
            v = b2 * v0 + (1 - b2) * g * g
            state = inner.state[master]
            t = int(state["step"])
            if t != step:
                raise AssertionError(f"optimizer step {t}, expected {step}")
            # Tolerances: a few float32 roundings of each term (no cancellation blow-up).
            _near("Adam m", state["exp_avg"], m, (b1 * m0).abs() + ((1 - b1) * g).abs())
            _near("Adam v", state["exp_avg_sq"], v, b2 * v0 + (1 - b2) * g * g)
            # The masters from the optimizer's (just checked) moments.
            denom = (state["exp_avg_sq"].sqrt() / (1 - b2**t) ** 0.5).add_(eps)
            update = (lr / (1 - b1**t)) * state["exp_avg"] / denom
            want = w0 * (1 - lr * wd) - update
            _near("FP32 master", master, want, w0.abs() + update.abs())
            if not torch.equal(p.view(torch.int16), master.to(p.dtype).view(torch.int16)):
                raise AssertionError("a BF16 parameter is not the cast of its FP32 master")
            changed += int((master != w0).sum())
        return changed


def _near(what: str, got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> None:
    err = (got - want).abs() - 1e-6 * scale
    if bool((err > 0).any()):
        raise AssertionError(f"{what} is not the AdamW update (worst excess {err.max():.3g})")


def run(args: argparse.Namespace, arch: ArchConfig, ids: torch.Tensor, lr: float) -> dict:
    """Train ``args.steps`` steps at ``lr``; per step, the changed elements per tensor."""
    model, _config, optimizer, scheduler = build(args, arch, lr)
    params = dict(unwrap(model).named_parameters())
    tensors = {
        n: dict(numel=p.numel(), dtype=str(p.dtype).removeprefix("torch."), cls=tensor_class(n))
        for n, p in params.items()
    }
    data = batches(ids, args.batch, args.seq, args.seed)
    steps = []
    for t in range(1, args.steps + 1):
        before = {n: p.detach().view(BITS[p.dtype]).clone() for n, p in params.items()}
        check = AdamCheck(optimizer)
        start = time.perf_counter()
        loss, grad_norm = train_step(model, optimizer, next(data))
        scheduler.step(1)
        seconds = time.perf_counter() - start
        masters = check.verify(t)
        changed = {
            n: int((p.detach().view(BITS[p.dtype]) != before[n]).sum()) for n, p in params.items()
        }
        steps.append(
            dict(
                step=t,
                loss=loss,
                grad_norm=grad_norm,
                seconds=seconds,
                changed=changed,
                master_changed=masters,
            )
        )
        steps[-1]["fraction"] = fractions(changed, tensors)
        print(
            f"lr {lr:g} step {t}: loss {loss:.4f}, changed {steps[-1]['fraction']['overall']:.4%}"
            f" ({seconds:.1f} s)",
            file=sys.stderr,
        )
    return dict(lr=lr, tensors=tensors, steps=steps)


def fractions(changed: dict[str, int], tensors: dict[str, dict]) -> dict[str, float]:
    """Changed elements / elements: overall, per class present, and per embedding part."""
    groups = {"overall": list(tensors)}
    for cls in COLUMNS:
        groups[cls] = [n for n, t in tensors.items() if t["cls"] == cls]
    for part, prefix in PARTS:
        groups[part] = [n for n in tensors if n.startswith(prefix)]
    return {
        key: sum(changed[n] for n in names) / sum(tensors[n]["numel"] for n in names)
        for key, names in groups.items()
        if names
    }


# -- report ---------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    """Per-step tables (one per lr) and the median after step 1 per class."""
    lines = []
    for r in result["runs"]:
        cols = [c for c in r["steps"][0]["fraction"] if c not in dict(PARTS)]
        lines += [
            f"lr = {r['lr']:g}:",
            "",
            "| step | loss | grad norm | " + " | ".join(cols) + " | FP32 masters |",
            "|---:|---:|---:|" + "---:|" * (len(cols) + 1),
        ]
        total = sum(t["numel"] for t in r["tensors"].values())
        for s in r["steps"]:
            cells = [f"{100 * s['fraction'][c]:.3f} %" for c in cols]
            master = f"{100 * s['master_changed'] / total:.1f} %"
            lines.append(
                f"| {s['step']} | {s['loss']:.3f} | {s['grad_norm']:.2f} | "
                + " | ".join(cells)
                + f" | {master} |"
            )
        lines.append("")
    cols = list(result["runs"][0]["steps"][0]["fraction"])
    lines += [
        "Median changed fraction over steps 2.." + str(result["args"]["steps"]) + ":",
        "",
        "| lr | " + " | ".join(cols) + " |",
        "|---:|" + "---:|" * len(cols),
    ]
    for r in result["runs"]:
        cells = [f"{100 * median_after_first(r, c):.3f} %" for c in cols]
        lines.append(f"| {r['lr']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def median_after_first(run_result: dict, cls: str) -> float:
    later = [s["fraction"][cls] for s in run_result["steps"][1:]] or [
        s["fraction"][cls] for s in run_result["steps"]
    ]
    return statistics.median(later)


def git_commit() -> str | None:
    """HEAD of the checkout this script runs from (at start), if it is one."""
    cmd = ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short", "HEAD"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    return out.stdout.strip() or None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-6, 3e-6])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--moe", action="store_true", help="4 experts, top-2 router, every layer")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=704)
    ap.add_argument("--vocab", type=int, default=32000, help="BPE vocabulary (at most)")
    ap.add_argument("--tokenizer", choices=("bpe", "byte"), default="bpe")
    ap.add_argument("--corpus-chars", type=int, default=1_500_000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip-grad", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", metavar="PATH", help="write the full result here ('-': stdout)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    commit = git_commit()
    import megatron.core
    from megatron.core import parallel_state as ps

    port = free_port()  # for the world of one
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    megatron_cpu.apply_cpu_patches()
    patch_optimizer_modules()
    ps.initialize_model_parallel()
    try:
        ids, vocab = tokenize(corpus(args.corpus_chars), args.tokenizer, args.vocab)
        arch = arch_config(args, vocab)
        runs = [run(args, arch, ids, lr) for lr in args.lr]
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    result = dict(
        args=vars(args),
        commit=commit,
        versions=dict(
            python=sys.version.split()[0],
            torch=torch.__version__,
            megatron_core=megatron.core.__version__,
        ),
        tokens=dict(corpus=len(ids), vocab=vocab, per_step=args.batch * args.seq),
        runs=runs,
    )
    table = markdown(result)
    if args.json == "-":
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        print(table)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
