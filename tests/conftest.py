"""Shared pytest setup: make ``tests/`` helpers importable and quiet framework warnings."""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
