"""Shared pytest setup: quiet framework warnings, and the ``requires`` mark's skips
(``tests/helpers/requires.py``). (``tests`` is a package: its helpers import as
``tests.helpers.*``, its subprocess programs run as ``python -m tests.programs.*``.)"""

from __future__ import annotations

import os
import warnings

import pytest

from tests.helpers.requires import skip_reason

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture of ``item`` is set up: skip it if a probe of one of its
    ``requires`` marks (nearest first) gives a reason."""
    for mark in item.iter_markers("requires"):
        for probe in mark.args:
            reason = skip_reason(probe)
            if reason is not None:
                pytest.skip(reason)
