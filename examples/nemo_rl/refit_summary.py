"""Per-step refit time and trainer-vs-generator logprob error from NeMo RL TensorBoard logs.

    python examples/nemo_rl/refit_summary.py LOG_DIR [LOG_DIR ...]

NeMo RL logs ``timing/train/prepare_for_generation/transfer_and_update_weights`` (the
refit, timed around ``sync_weights``), ``train/token_mult_prob_error`` (exp of the mean
|Δlogprob| per token between trainer and generator) and
``train/max_seq_mult_prob_error`` (the worst sequence's). ``max |Δlogprob|`` below is
``log(max_seq_mult_prob_error)``: the largest mean |Δlogprob| of any sequence. A refit
that writes wrong weights makes it jump; matching refits give the same small values.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

REFIT = "timing/train/prepare_for_generation/transfer_and_update_weights"
TOKEN = "train/token_mult_prob_error"
WORST = "train/max_seq_mult_prob_error"


def scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for events in sorted(log_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def main(dirs: list[str]) -> None:
    print(f"{'run':<12} {'step':>4} {'refit s':>9} {'tok err':>9} {'max |dlogp|':>12}")
    for d in dirs:
        s = scalars(Path(d))
        for step in sorted(s.get(REFIT, {}) | s.get(TOKEN, {})):
            refit = s.get(REFIT, {}).get(step, float("nan"))
            token = s.get(TOKEN, {}).get(step, float("nan"))
            worst = s.get(WORST, {}).get(step, float("nan"))
            dlogp = math.log(worst) if worst > 0 else float("nan")
            print(f"{Path(d).name:<12} {step:>4} {refit:>9.3f} {token:>9.4f} {dlogp:>12.5f}")


if __name__ == "__main__":
    main(sys.argv[1:])
