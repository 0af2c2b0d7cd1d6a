"""Shared check: a plan delivers every destination element exactly once, bit-exact."""

from __future__ import annotations

import torch

from nemo_refit_reshard.engine.materialize import empty_like_layout, materialize, mismatches
from nemo_refit_reshard.engine.simulate import simulate_plan
from nemo_refit_reshard.plan import verify_plan


def assert_delivers_exactly(plan, spec, sources, destinations, seed: int = 0):
    """``verify_plan``, then one in-process refit of random weights: every destination
    element equals its canonical value and padding stays untouched (NaN). Returns the
    source and destination tensors and the canonical weights."""
    verify_plan(plan, sources, destinations)
    g = torch.Generator().manual_seed(seed)
    canonical = {t.name: torch.randn(t.shape, generator=g) for t in spec}
    src = [materialize(lay, canonical) for lay in sources]
    dst = [empty_like_layout(lay) for lay in destinations]
    simulate_plan(plan, src, dst)
    for lay, tensors in zip(destinations, dst):
        assert mismatches(lay, tensors, canonical) == [], lay.rank
        for t in lay.tensors:  # padding is never written: it stays NaN
            for pad in t.padding:
                assert torch.isnan(tensors[t.name][pad.slices()]).all()
    return src, dst, canonical
