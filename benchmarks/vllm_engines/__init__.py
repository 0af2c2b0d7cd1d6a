"""The engines of ``benchmarks/vllm_engines_bytes.py``, one module each.

- :mod:`.common`: one case built once (our layouts and plan, what each training rank
  holds, the representative names vLLM's ranks are built with) and :class:`Figures`;
- :mod:`.reshard`: ours, from the plan;
- :mod:`.nccl`: vLLM's broadcast engine, packed and not;
- :mod:`.m2n`: vLLM's ``nccl_m2n``, its own destination resolution per worker;
- :mod:`.sharded_rdt`: vLLM's sharded RDT engine, its own bake per worker.

vLLM is imported inside the functions: the CLI imports this package only under
``.venv-vllm``.
"""
