"""A pytest plugin that records the fingerprint of every refit plan the suite builds.

    python -m pytest -q -p scripts.record_plan_fingerprints --fingerprints-out FILE \
        --hypothesis-seed=0

Writes one JSON object: test node id -> the fingerprints of the plans built in that test,
in build order (a plan of a model read from a temporary config file by its content, the
file's folder left out; ``--hypothesis-seed=0`` makes the property tests' cases the same
on every run). Two runs of the suite on two codes are then compared with
``python scripts/compare_fingerprints.py BEFORE AFTER``: a move that keeps every plan gives
identical files. Plans built in subprocesses (the spawned refit workers) are not seen;
the ones their parents built are.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict

import pytest

from nemo_refit_reshard.plan import RefitPlan

_BUILT: dict[str, list[str]] = defaultdict(list)
_CURRENT = ["<collection>"]
_original_init = RefitPlan.__init__


def _content(plan: RefitPlan) -> str:
    """The plan's fingerprint, or where its model is a config file (tests write them to
    fresh temporary folders, whose paths are part of the plan), the hash of its JSON body
    with the model named by the file's name alone."""
    if "/" not in plan.model:
        return plan.fingerprint
    body = json.loads(plan.to_json())  # the body, read back from the plan's own JSON
    body.pop("fingerprint", None)
    body["model"] = os.path.basename(body["model"])
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return "content:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _recording_init(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
    _original_init(self, *args, **kwargs)
    _BUILT[_CURRENT[0]].append(_content(self))


RefitPlan.__init__ = _recording_init  # type: ignore[method-assign]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fingerprints-out", default="plan_fingerprints.json")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    _CURRENT[0] = item.nodeid
    try:
        return (yield)
    finally:
        _CURRENT[0] = "<between tests>"


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = session.config.getoption("--fingerprints-out")
    with open(path, "w") as f:
        json.dump(dict(sorted(_BUILT.items())), f, indent=1)
