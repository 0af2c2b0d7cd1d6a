"""End-to-end GRPO example: a vLLM-layout generator refit from Megatron-layout training."""
