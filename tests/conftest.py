"""Shared pytest setup: quiet framework warnings. (``tests`` is a package: its helpers
import as ``tests.helpers.*``, its subprocess programs run as ``python -m tests.programs.*``.)"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
