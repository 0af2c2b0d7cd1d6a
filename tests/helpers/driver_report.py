"""The result file of a test driver program (a subprocess under another venv's Python)."""

from __future__ import annotations

import json
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def report_to(path: str) -> Iterator[dict[str, Any]]:
    """Yield the result dict; write it as JSON at the end, replaced by the error and its
    traceback if the body raised (the test asserts on them)."""
    result: dict[str, Any] = {}
    try:
        yield result
    except BaseException as err:
        result.clear()
        result.update(error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
    finally:
        with open(path, "w") as f:
            json.dump(result, f, default=str)
