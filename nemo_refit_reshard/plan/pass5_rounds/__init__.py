"""Pass 5, rounds: which round each part of each route goes in.

``rounds.py`` is the pass (:func:`plan_rounds`, :class:`Rounds`). Without a topology,
and for relay chains, rounds are filled first-fit (``first_fit.py``, its parts cut and
grouped by ``first_fit_parts.py``). With one they are time-budgeted (``timed.py``):
pairs and their per-round loads (``pair_loads.py``), the fill that places them round by
round (``fill.py``, its steps and state in ``fill_steps.py``, with what no budget changes
set up once in ``fill_setup.py``), the budget chosen by pricing fills side by side
(``budget.py``), stopped early by a lower bound (``price_limit.py``).
"""

from .rounds import Rounds, plan_rounds

__all__ = ["Rounds", "plan_rounds"]
