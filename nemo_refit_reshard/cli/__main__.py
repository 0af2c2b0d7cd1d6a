"""``python -m nemo_refit_reshard.cli``: the same as ``nemo-refit-reshard``."""

import sys

from . import main

sys.exit(main())
