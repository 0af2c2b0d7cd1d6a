"""No import cycles in ``integrations/`` or the CPU GRPO application (lazy imports count:
``scripts/check_import_cycles.py`` reads every import statement)."""

from __future__ import annotations

from pathlib import Path

from scripts.check_import_cycles import import_cycles

PACKAGE = Path(__file__).resolve().parent.parent / "nemo_refit_reshard"
CHECKED = ("nemo_refit_reshard.integrations", "nemo_refit_reshard.grpo_cpu")


def test_no_import_cycles_in_integrations_or_grpo_cpu() -> None:
    found = [
        group
        for group in import_cycles([PACKAGE])
        if any(m == p or m.startswith(p + ".") for m in group for p in CHECKED)
    ]
    assert found == []
