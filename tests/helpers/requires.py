"""Skip a test that needs a framework install, decided when the test is about to run.

A probe such as ``vllm_env.verl_skip_reason`` starts the framework venv's Python and
imports the framework (seconds each, ~1 minute for all of them). Run at import, as a
``skipif`` condition, it was paid at collection even for the tests ``-m "not slow"``
deselects; ``tests/conftest.py`` runs each probe of a ``requires`` mark only for a test
that runs, once a session."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

Probe = Callable[[], "str | None"]


def requires(*probes: Probe) -> pytest.MarkDecorator:
    """Skip with the first reason one of ``probes`` gives (None: what it probes is there)."""
    return pytest.mark.requires.with_args(*probes)


@functools.cache
def skip_reason(probe: Probe) -> str | None:
    """``probe()``, run once a session."""
    return probe()
