"""Command line: ``nemo-refit-reshard <command>``, one module per command family.

``models.py``: ``layout`` and ``models``; ``plan.py``: ``plan`` and ``simulate``;
``run.py``: ``demo`` and ``bench`` (on the local runner, ``nemo_refit_reshard.runner``);
``gpu_check.py``: ``gpu-check``. ``parser.py`` wires them to their arguments.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Sequence

from .parser import make_parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command (``argv``, else ``sys.argv[1:]``); its exit status. A
    ``ValueError`` is a usage error: one line on stderr, status 2.

    Run as the program (``argv`` None), ``plan`` and ``simulate`` leave their objects to
    the operating system: a 256-GPU plan is tens of millions of small objects, which
    the interpreter would otherwise spend seconds collecting and freeing one by one
    after the output is written (the cyclic collector stays off until then)."""
    parser = make_parser()
    args = parser.parse_args(argv)
    fast_exit = argv is None and getattr(args, "fast_exit", False)
    if fast_exit:
        gc.disable()
    try:
        status = int(args.func(args))
    except ValueError as err:
        print(f"nemo-refit-reshard: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
        return 0
    if fast_exit:
        exit_now(status)
    return status


def exit_now(status: int) -> None:
    """End the process with ``status`` once its output is written, skipping the
    interpreter's teardown."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # a closed pipe or stream: nothing to write
            pass
    os._exit(status)


__all__ = ["main", "make_parser"]
