"""The plan as built: :class:`~.refit_plan.RefitPlan` (messages per round, stats,
fingerprint, JSON), its expansion to every rank (``expand.py``), the JSON encoding of
messages (``serialize.py``), and one rank's share of it (``rank_share.py``)."""
