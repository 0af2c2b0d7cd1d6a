"""Which weights a generation rank holds: the last complete refit, or stale.

A refit writes a rank's tensors piece by piece; if it fails or is interrupted halfway
the rank holds a mix of two steps' weights. :class:`WeightsState` records every refit
as a version — the step number and the plan's fingerprint — and marks the weights stale
from the moment a refit starts until it completes. A stale rank refuses to generate
(:class:`StaleWeightsError`, naming the step that failed) until a later refit succeeds.
"""

from __future__ import annotations

from dataclasses import dataclass


class StaleWeightsError(RuntimeError):
    """Generation refused: the weights may be torn (a refit failed or did not finish)."""


@dataclass
class WeightsState:
    """A rank's weights version: the last complete refit, and why they are stale if so."""

    step: int | None = None  # the last complete refit's step (None: the initial weights)
    fingerprint: str | None = None  # ... and its plan
    stale: str | None = None  # why the weights may be torn; None when they are whole

    def begin(self, step: int, fingerprint: str) -> None:
        self.stale = f"the refit of step {step} (plan {fingerprint[:12]}) did not finish"

    def done(self, step: int, fingerprint: str) -> None:
        self.step, self.fingerprint, self.stale = step, fingerprint, None

    def failed(self, step: int, err: BaseException) -> None:
        lines = str(err).strip().splitlines()
        self.stale = (
            f"the refit of step {step} failed ({type(err).__name__}: {lines[0] if lines else ''})"
        )

    @property
    def fresh(self) -> bool:
        return self.stale is None

    def require_fresh(self, what: str = "generation") -> None:
        if self.stale is not None:
            raise StaleWeightsError(
                f"{what} refused: the weights may be torn: {self.stale}; a later refit must "
                "succeed first"
            )

    def as_dict(self) -> dict[str, object]:
        return {"step": self.step, "fingerprint": self.fingerprint, "stale": self.stale}
