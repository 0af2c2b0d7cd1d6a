"""A deliberately broken Megatron rule, for negative controls of the end-to-end refit
tests: the layout provider's fused-QKV rule with k and v swapped.

Those tests fill their Megatron ranks through Megatron's own sharded state dict
(``megatron_cpu.load_hf_through_sharded_state_dict``), so a wrong rule in our provider
must make them fail; with the ranks filled through our own layout it would cancel out.
``NRR_BROKEN_MEGATRON_RULE=kv`` installs it in a test program's processes
(:func:`install_from_env`); in the test process itself,
``monkeypatch.setattr(rule_owner(), "qkv", kv_swapped(rule_owner().qkv))``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

ENV = "NRR_BROKEN_MEGATRON_RULE"


def _swap(name: str) -> str:
    return name.replace("k_proj", "\0").replace("v_proj", "k_proj").replace("\0", "v_proj")


def kv_swapped(original: Callable[..., None]) -> Callable[..., None]:
    """The provider's ``qkv`` rule with k and v placed in each other's rows."""

    def qkv(self: Any, local: str, hf: str, suffix: str) -> None:
        rows = self.b.rows

        def swapped(name: str, segments: list, *args: Any, **kwargs: Any) -> None:
            rows(name, [(o, n, _swap(c), s) for o, n, c, s in segments], *args, **kwargs)

        self.b.rows = swapped
        try:
            original(self, local, hf, suffix)
        finally:
            self.b.rows = rows

    return qkv


def rule_owner() -> type:
    """The Megatron provider's per-rank class, whose ``qkv`` is the rule."""
    from nemo_refit_reshard.layouts import megatron

    return megatron._MegatronRank


def install_from_env() -> None:
    """In a test program's process: break the rule ``$NRR_BROKEN_MEGATRON_RULE`` names."""
    rule = os.environ.get(ENV)
    if rule == "kv":
        rule_owner().qkv = kv_swapped(rule_owner().qkv)
    elif rule:
        raise ValueError(f"{ENV}={rule!r}: the one broken rule is 'kv'")
