"""NeMo RL GRPO with ``refit.backend`` chosen in the config: ``reshard`` (ours), ``nccl`` or
``nccl_reshard`` (NeMo RL's own), for side-by-side runs on the same config.

    python examples/nemo_rl/run_grpo.py \
        --config configs/nemo_rl/grpo_math_qwen3_8B_megatron_reshard.yaml
    python examples/nemo_rl/run_grpo.py --config ... refit.backend=nccl grpo.max_num_steps=20

The overlay's ``defaults:`` is looked up beside it, then in NeMo RL's own
``examples/configs`` (``--nemo-rl-configs`` to point elsewhere). Hydra overrides work as
in NeMo RL's ``examples/run_grpo.py``, which this follows step for step; the only
changes are the policy worker (``reshard``: NeMo RL's Megatron worker plus our refit
methods) and the weight synchronizer GRPO's refit calls. A bad value in the config
prints one line naming the key, the value and the choices, and exits with status 2; so
do, once Ray has started, fewer GPUs than the config places the job on
(``cluster.gpus_per_node`` x ``cluster.num_nodes``) and a tokenizer that cannot be loaded.
With ``grpo.async_grpo.enabled=true`` it runs NeMo RL's ``async_grpo_train`` as NeMo RL's
script does (its async rules checked first, one line each); every refit there is GRPO's
``refit_policy_generation``, so ``reshard`` serves it, drained or with
``in_flight_weight_updates``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def nemo_rl_configs() -> Path:
    """NeMo RL's own ``examples/configs`` (beside the installed ``nemo_rl`` package)."""
    import nemo_rl

    return Path(nemo_rl.__file__).resolve().parents[1] / "examples" / "configs"


def load(config: str, overrides: list[str], base_dir: str | None) -> dict[str, Any]:
    """The overlay with its NeMo RL defaults and the Hydra overrides, resolved."""
    from nemo_rl.utils.config import (
        load_config_with_inheritance,
        parse_hydra_overrides,
        register_omegaconf_resolvers,
    )
    from omegaconf import OmegaConf

    register_omegaconf_resolvers()
    path = Path(config)
    defaults = OmegaConf.load(path).get("defaults")
    beside = defaults is None or all(
        (path.parent / str(d)).exists()
        for d in ([defaults] if isinstance(defaults, str) else defaults)
    )
    base = path.parent if beside and base_dir is None else Path(base_dir or nemo_rl_configs())
    cfg = load_config_with_inheritance(path, base)
    if overrides:
        cfg = parse_hydra_overrides(cfg, overrides)
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def one_line(err: BaseException) -> str:
    """The error's message on one line (Ray's and transformers' span several)."""
    return " ".join(str(err).split()) or type(err).__name__


def ray_hint(message: str) -> str:
    """What to do about the two start-up failures a new environment meets."""
    if "Version mismatch" in message:
        # init_ray first joins any Ray cluster running on this machine ("auto"), even one
        # another job started under another Python.
        return (
            "; NeMo RL's init_ray joined a Ray cluster already running on this machine: "
            "stop it, or set RAY_ADDRESS=local to start one for this run"
        )
    if "dashboard" in message:
        # init_ray starts its own cluster with the dashboard, which plain `ray` lacks.
        return "; install ray[default] (scripts/setup_nemo_rl_cpu.sh does)"
    return ""


def ray_gpus() -> float:
    """The GPUs of the Ray cluster ``init_ray`` started or joined."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0))


def gpus_needed(cluster: dict[str, Any]) -> tuple[int, str] | None:
    """The GPUs NeMo RL's setup places the job on (``cluster.gpus_per_node`` x
    ``cluster.num_nodes``) and how to say so, or None when the config does not say."""
    per_node, nodes = cluster.get("gpus_per_node"), cluster.get("num_nodes")
    if not isinstance(per_node, int) or not isinstance(nodes, int):
        return None
    return per_node * nodes, (
        f"{per_node * nodes} GPUs (cluster.gpus_per_node={per_node} x cluster.num_nodes={nodes})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="NeMo RL YAML overlay with a refit block")
    parser.add_argument("--nemo-rl-configs", default=None, help="where the overlay's defaults are")
    args, overrides = parser.parse_known_args()

    from nemo_rl.utils.config import OverridesError
    from omegaconf.errors import OmegaConfBaseException

    from nemo_refit_reshard.integrations.nemo_rl.config import NemoRlConfigError
    from nemo_refit_reshard.integrations.nemo_rl.grpo import (
        async_grpo,
        check_reshard_config,
        install_synchronizer,
        policy_factory,
        refit_config,
    )
    from nemo_refit_reshard.plan import PlanError

    try:
        raw = load(args.config, overrides, args.nemo_rl_configs)
        refit = refit_config(raw)
        if refit.backend == "reshard":
            check_reshard_config(raw)
        run_async = async_grpo(raw)
    except (NemoRlConfigError, FileNotFoundError, OverridesError, OmegaConfBaseException) as err:
        print(f"error: {str(err).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"refit.backend={refit.backend}", flush=True)

    from nemo_rl.algorithms.grpo import MasterConfig, grpo_train, setup, shutdown_environments
    from nemo_rl.algorithms.utils import get_tokenizer
    from nemo_rl.data.utils import setup_response_data
    from nemo_rl.distributed.virtual_cluster import init_ray
    from nemo_rl.models.generation import configure_generation_config
    from nemo_rl.utils.logger import get_next_experiment_dir

    config = MasterConfig(**raw)
    config.logger["log_dir"] = get_next_experiment_dir(config.logger["log_dir"])
    try:
        init_ray()
    except Exception as err:  # any start-up failure: Ray's reason is the user's to fix
        message = one_line(err).rstrip(".")
        print(f"error: Ray did not start: {message}{ray_hint(message)}", file=sys.stderr)
        return 2
    gpus = ray_gpus()
    print(f"ray started: {gpus:g} GPUs", flush=True)
    needed = gpus_needed(config.cluster)
    if needed is not None and gpus < needed[0]:
        # Said here, in one line: NeMo RL's setup finds out only after the tokenizer and
        # dataset downloads, retries its placement groups for about a minute and ends in a
        # ResourceInsufficientError traceback.
        print(f"error: this run needs {needed[1]}; Ray sees {gpus:g}", file=sys.stderr)
        return 2
    try:
        tokenizer = get_tokenizer(config.policy["tokenizer"])
    except (OSError, ValueError) as err:  # transformers' "cannot be loaded" errors
        name = config.policy["tokenizer"]["name"]
        print(
            f"error: tokenizer {name} cannot be loaded: {one_line(err).rstrip('.')}; set "
            "policy.tokenizer.name to a local copy or make the Hugging Face hub reachable",
            file=sys.stderr,
        )
        return 2
    megatron_cfg = config.policy.get("megatron_cfg") or {}
    config.policy["generation"] = configure_generation_config(
        config.policy["generation"],
        tokenizer,
        has_refit_draft_weights=bool(config.policy["draft"]["enabled"]),
        trains_mtp=bool(megatron_cfg.get("mtp_num_layers")),
    )
    dataset, val_dataset, task_to_env, val_task_to_env = setup_response_data(
        tokenizer, config.data, config.env
    )
    (
        policy,
        policy_generation,
        _nemo_gym,
        _clusters,
        dataloader,
        val_dataloader,
        loss_fn,
        logger,
        checkpointer,
        grpo_state,
        master_config,
        _teachers,
        _aliases,
    ) = setup(config, tokenizer, dataset, val_dataset, policy_factory=policy_factory(refit, raw))
    try:
        try:
            sync = install_synchronizer(refit, policy, policy_generation, raw)
        except (NemoRlConfigError, PlanError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"weight synchronizer: {type(sync).__name__}", flush=True)
        if run_async:
            from nemo_rl.algorithms.grpo import async_grpo_train

            print("async GRPO", flush=True)
            async_grpo_train(
                policy=policy,
                policy_generation=policy_generation,
                dataloader=dataloader,
                val_dataloader=val_dataloader,
                tokenizer=tokenizer,
                loss_fn=loss_fn,
                task_to_env=task_to_env,
                val_task_to_env=val_task_to_env,
                logger=logger,
                checkpointer=checkpointer,
                grpo_save_state=grpo_state,
                master_config=master_config,
                max_trajectory_age_steps=config.grpo.async_grpo.max_trajectory_age_steps,
                teacher_worker_groups=_teachers,
                alias_to_group_alias=_aliases,
            )
            return 0
        with checkpointer:
            grpo_train(
                policy,
                policy_generation,
                dataloader,
                val_dataloader,
                tokenizer,
                loss_fn,
                task_to_env,
                val_task_to_env,
                logger,
                checkpointer,
                grpo_state,
                master_config,
            )
    finally:
        shutdown_environments(task_to_env, val_task_to_env)
        policy_generation.shutdown()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
