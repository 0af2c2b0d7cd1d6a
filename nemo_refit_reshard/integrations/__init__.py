"""Layer 5: the library inside training and inference frameworks, by role.

- ``worker``: the framework-neutral worker API (:class:`RefitWorker`, :class:`RefitEndpoint`,
  the weights' version and staleness).
- ``checkpoint_engine``: the core shared by the veRL and NeMo RL checkpoint engines
  (replicated full-tensor plans, one rank's engine logic, the plan cache, the group's
  address).
- ``megatron``: Megatron helpers (a live worker's tensors, options and position; CPU
  megatron-core models).
- ``vllm``: the worker side inside real vLLM engines, and reading a vLLM engine's config.
- ``nemo_rl``: NeMo RL's ``refit.backend: reshard`` synchronizer and Megatron worker, and
  its drop-in checkpoint engine.
- ``verl``: veRL's ``reshard`` checkpoint engine.
- ``hydra_config``: a Hydra config with overrides, every config error one line.
- ``spawn``: the CLI's local multi-process runner.
"""
