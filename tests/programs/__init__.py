"""Programs the tests run as subprocesses (``python -m tests.programs.NAME``), often
under another virtual environment's Python (vLLM's, veRL's, NeMo RL's)."""
