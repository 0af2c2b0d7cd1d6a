"""Command line: ``nemo-refit-reshard <command>``, one module per command family.

``models.py``: ``layout`` and ``models``; ``plan.py``: ``plan`` and ``simulate``;
``run.py``: ``demo`` and ``bench`` (on the local runner, ``nemo_refit_reshard.runner``);
``gpu_check.py``: ``gpu-check``. ``parser.py`` wires them to their arguments.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .parser import make_parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command (``argv``, else ``sys.argv[1:]``); its exit status. A
    ``ValueError`` is a usage error: one line on stderr, status 2."""
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as err:
        print(f"nemo-refit-reshard: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stderr.close()
        return 0


__all__ = ["main", "make_parser"]
