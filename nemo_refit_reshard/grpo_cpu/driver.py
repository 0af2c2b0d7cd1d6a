"""The GRPO loop on Ray: generate -> score -> train -> refit, step after step.

:func:`run_grpo` is everything ``examples/grpo_cpu.py`` does, without Hydra, so tests
call it directly. The plan is built once here, before Ray starts (configuration errors
surface without a single process), and each worker receives its slice as JSON.

Per step:

1. the step's prompts (each repeated ``group_size`` times) are split by whole groups
   over the generation replicas; every tp rank of a replica gets the same prompts and
   seed, and the replica's tokens and log-probabilities come back from its tp rank 0;
2. every training rank scores the same tokens with the current (pre-update) policy
   and takes one GRPO step; ``max |Δlogprob|`` compares the generator's and the
   trainer's log-probabilities of the sampled tokens;
3. refit: with ``refit.compare_broadcast`` the other backend first (same weights, timed
   only), then ``refit.backend``, which leaves the generator with the new weights. With
   ``refit.delta`` each message goes in its smallest form (``engine/delta/program.py``); the
   report has the bytes the training actors sent and what the step weighs dense.

Step 0 is one refit per backend before the first generation: the generator starts from
the trainer's initial weights, and gloo's lazily opened connections are not billed to
step 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..plan import plan_broadcast, plan_refit
from .cluster import GrpoCluster
from .config import GrpoRunConfig
from .elastic import ElasticRefit
from .plans import broadcast_without_canonical, build_layouts, without_canonical
from .report import StepReport, format_step


@dataclass(frozen=True)
class RefitEvent:
    """Passed to ``after_refit`` after every refit (step 0 = the initial one).
    ``replicas``: the generation replicas that hold the step (all but fenced ones)."""

    step: int
    backend: str
    cluster: GrpoCluster
    replicas: tuple[int, ...] = ()
    elastic: ElasticRefit | None = None


def run_grpo(
    cfg: GrpoRunConfig,
    after_refit: Callable[[RefitEvent], None] | None = None,
    on_step: Callable[[StepReport], None] | None = None,
) -> list[StepReport]:
    """Run ``cfg.num_steps`` GRPO steps on a local Ray cluster; one report per step.

    Starts Ray with ``ray.num_cpus`` CPUs unless it is already running (then it is
    reused and left running). Actors are always killed at the end, also on errors."""
    import ray

    spec, sources, destinations = build_layouts(cfg.policy, cfg.train, cfg.infer, cfg.infer_dtype)
    plan = plan_refit(spec, sources, destinations, bucket_mb=cfg.refit.bucket_mb)
    uses_broadcast = "broadcast" in cfg.refit.backends
    bplan = (
        plan_broadcast(spec, sources, destinations, cfg.refit.bucket_mb) if uses_broadcast else None
    )
    if cfg.test_only_drop_tensor is not None:
        plan = without_canonical(plan, cfg.test_only_drop_tensor)
        if bplan is not None:
            bplan = broadcast_without_canonical(bplan, cfg.test_only_drop_tensor)
    nbytes = {"reshard": plan.stats.total_bytes}
    if bplan is not None:
        nbytes["broadcast"] = bplan.total_bytes

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(
            num_cpus=cfg.ray.num_cpus,
            include_dashboard=False,
            log_to_driver=cfg.ray.log_to_driver,
            logging_level="WARNING",
        )
    shapes = {t.name: t.shape for t in spec}
    cluster = GrpoCluster(cfg, plan, bplan, sources, destinations, shapes)
    elastic = None
    if cfg.faults.active:
        elastic = ElasticRefit(cfg, cluster, plan, spec, sources, destinations)
    try:
        if elastic is not None:
            elastic.start()
        else:
            cluster.start()
        steps = _Steps(cfg, cluster, nbytes, elastic, after_refit)
        steps.refit(0)
        return _loop(cfg, steps, on_step)
    finally:
        cluster.shutdown()
        if started_ray:
            ray.shutdown()


class _Steps:
    """Each step's refit(s) and generation, over every replica or the membership's."""

    def __init__(
        self,
        cfg: GrpoRunConfig,
        cluster: GrpoCluster,
        nbytes: dict[str, int],
        elastic: ElasticRefit | None,
        after_refit: Callable[[RefitEvent], None] | None,
    ) -> None:
        self.cfg, self.cluster, self.nbytes = cfg, cluster, nbytes
        self.elastic, self.after_refit = elastic, after_refit

    @property
    def replicas(self) -> tuple[int, ...]:
        if self.elastic is not None:
            return self.elastic.serving
        return tuple(range(self.cfg.num_replicas))

    def refit(self, step: int) -> tuple[dict[str, float], tuple[int, int] | None]:
        """Every backend's refit of ``step`` (the real one last); seconds per backend
        and a delta refit's bytes."""
        seconds: dict[str, float] = {}
        delta: tuple[int, int] | None = None
        for backend in self.cfg.refit.backends:
            if self.elastic is not None:
                seconds[backend] = self.elastic.refit(step)
                delta = self.elastic.last_delta or delta
                self.nbytes[backend] = self.elastic.bytes_per_refit
            else:
                seconds[backend] = self.cluster.refit(backend, step)
                delta = self.cluster.last_delta or delta
            if self.after_refit is not None:
                event = RefitEvent(step, backend, self.cluster, self.replicas, self.elastic)
                self.after_refit(event)
        return seconds, delta


def _loop(
    cfg: GrpoRunConfig, steps: _Steps, on_step: Callable[[StepReport], None] | None
) -> list[StepReport]:
    g, task, cluster = cfg.grpo, cfg.task, steps.cluster
    prompt_gen = torch.Generator().manual_seed(cfg.seed)
    bar = _progress(cfg)
    reports = []
    try:
        for step in range(1, cfg.num_steps + 1):
            t0 = time.perf_counter()
            prompts = task.sample_prompts(g.prompts_per_step, prompt_gen)
            prompts = prompts.repeat_interleave(g.group_size, dim=0)
            if steps.elastic is not None:
                steps.elastic.before_generation(step)
            completions, gen_logprobs = _generate(cfg, cluster, prompts, step, steps.replicas)
            rewards = task.reward(prompts, completions)
            tokens = torch.cat([prompts, completions], dim=1)
            results = cluster.call_all(
                cluster.trainers,
                "score_and_train",
                (tokens, task.prompt_len, rewards, g.group_size),
                cfg.ray.call_timeout_s,
                f"step {step}, training",
            )
            train_logprobs, metrics = results[0]
            diff = float((gen_logprobs - train_logprobs).abs().max())
            seconds, delta = steps.refit(step)
            report = StepReport(
                step=step,
                reward=float(rewards.mean()),
                refit_seconds=seconds,
                refit_bytes={b: steps.nbytes[b] for b in seconds},
                max_logprob_diff=diff,
                seconds=time.perf_counter() - t0,
                metrics=metrics,
                delta_bytes=delta,
                engines=steps.replicas if steps.elastic is not None else None,
            )
            reports.append(report)
            if bar is not None:
                for event in steps.elastic.events if steps.elastic is not None else ():
                    bar.write(event)
                if steps.elastic is not None:
                    steps.elastic.events.clear()
                bar.write(format_step(report, cfg.refit.backend))
                bar.update(1)
            if on_step is not None:
                on_step(report)
    finally:
        if bar is not None:
            bar.close()
    if cfg.progress and steps.elastic is not None:
        print(steps.elastic.membership)
    return reports


def _generate(
    cfg: GrpoRunConfig,
    cluster: GrpoCluster,
    prompts: torch.Tensor,
    step: int,
    replicas: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample on every replica of ``replicas`` (whole prompt groups per replica);
    tokens, logprobs."""
    if len(prompts) % (len(replicas) * cfg.grpo.group_size):
        raise RuntimeError(
            f"step {step}: {len(prompts) // cfg.grpo.group_size} prompt groups do not split "
            f"over the {len(replicas)} generation replicas serving {list(replicas)}; set "
            "grpo.prompts_per_step to a multiple of every count of engines the run can serve"
        )
    chunks = dict(zip(replicas, prompts.chunk(len(replicas), dim=0)))
    calls = []
    actors = [a for a in cluster.generators if a.replica in chunks]
    for a in actors:
        # One seed per (run, step, replica): tp ranks of a replica must agree on it.
        seed = (cfg.seed * 1_000_003 + step) * 1009 + a.replica
        args = (chunks[a.replica], cfg.grpo.max_new_tokens, cfg.grpo.temperature, seed)
        calls.append((a, a.handle.generate.remote(*args)))
    out = cluster.gather(calls, cfg.ray.call_timeout_s, f"step {step}, generation")
    per_replica: dict[int, Any] = {a.replica: o for a, o in zip(actors, out) if a.tp_rank == 0}
    tokens = torch.cat([per_replica[r][0] for r in replicas])
    logprobs = torch.cat([per_replica[r][1] for r in replicas])
    return tokens, logprobs


def _progress(cfg: GrpoRunConfig) -> Any:
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.num_steps, desc="GRPO steps", unit="step")
