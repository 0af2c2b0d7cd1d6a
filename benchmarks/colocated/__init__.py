"""Figures of ``benchmarks/colocated_bytes.py``: one module per colocated refit.

``common.py``: the case (model, layouts, our colocated plan) and the figures' shape;
``ours.py``: ``reshard-colocated``; ``export.py``: Megatron-Bridge's HF export, which
both other systems start from; ``nemo_rl.py``: NeMo RL's colocated (CUDA IPC over ZMQ)
refit; ``vllm_ipc.py``: vLLM 0.33's ``ipc`` weight-transfer engine.
"""
