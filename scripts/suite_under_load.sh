#!/usr/bin/env bash
# The README's test command while other processes keep every core busy: proves that no
# test leans on a fixed short timeout (every rendezvous, connect and wait takes its
# deadline from the caller's settings). Prints the suite's wall time under load.
#
#   bash scripts/suite_under_load.sh [pytest args...]     # default: the whole suite
set -euo pipefail
cd "$(dirname "$0")/.."
CORES="$(nproc)"
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; }
trap cleanup EXIT
# Ray starts its workers at niceness 15: next to a busy loop at 0 they would get a
# twentieth of a core (measured: 4% each), a test of the kernel's scheduler rather than
# of our deadlines. Run them at 0 like every other process, so the load takes an even
# share from everything.
export RAY_worker_niceness=0
for _ in $(seq "$CORES"); do
    python3 -c 'while True: pass' &   # one busy loop per core, for the whole run
    pids+=("$!")
done
echo "load: $CORES busy processes on $CORES cores (Ray workers at niceness 0)"
start=$(date +%s)
python3 -m pytest -q "$@"
echo "suite under load: $(( $(date +%s) - start )) s"
