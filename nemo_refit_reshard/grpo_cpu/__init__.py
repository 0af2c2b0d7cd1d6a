"""The CPU GRPO-on-Ray example application (``examples/grpo_cpu.py``): a vLLM-layout
generator refit from Megatron-layout training, on CPU.

``driver.py`` runs the loop (generate -> score -> train -> refit) over the actors of
``cluster.py``/``actors.py``; ``trainer.py`` (megatron-core, ``loss.py``) and
``generator.py`` are the two sides; ``task.py`` the toy task and policy; ``plans.py``
the driver's plan work; ``config.py`` the run's config; ``report.py`` the step reports.
An application built on the library, not one of its framework adapters.
"""
