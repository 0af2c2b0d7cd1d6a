"""About plans, not part of building them: predicted time on a cluster model
(``predict.py``), the bandwidth floor (``floor.py``), the gather-broadcast baseline and
its prediction (``baseline.py``), and an independent check of a plan (``verify.py``)."""
