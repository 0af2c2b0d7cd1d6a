#!/usr/bin/env bash
# shellcheck disable=SC2317  # the head_* functions are called by name, through run_check
# Every GPU check of the project in one run, on one GPU, within 10 minutes (one H200),
# then one summary table. Run from anywhere; it works in the repository root:
#
#   bash scripts/gpu_checks.sh [OUTDIR]      # default $OUT if set, else <repo>/gpu_checks_out/
#
# Each check runs under its own wall-clock limit (`timeout`, seconds below; override
# with the variable named), its whole output in OUTDIR/<check>.log; a failure never
# stops the run. TOTAL_S (570 s) caps the run (the limits on one GPU add up to 600 s):
# a check gets at most what is left of it, and is skipped when under 10 s is left.
#
#   gpu-check        nemo-refit-reshard gpu-check (NCCL, pack/unpack, overlapped replay)  GPU_CHECK_S=180
#   pytest-gpu       the tests marked gpu (pytest -m gpu)                                  PYTEST_GPU_S=60
#   colocated-demo   demo --colocated --device cuda: every training/inference pair on the
#                    one GPU, staging shared by CUDA IPC, bit-exact                        COLOCATED_DEMO_S=90
#   ipc-devices      cli/ipc_check.py: a staging exported by one process, opened by a second
#                    with the same and (>= 2 GPUs) reversed CUDA_VISIBLE_DEVICES: same GPU
#                    by UUID, same bytes, nothing left in /dev/shm                         IPC_DEVICES_S=30
#   vllm-check       benchmarks/gpu_vllm_check.py: a real vllm.LLM refit, vs HF            VLLM_CHECK_S=180
#   colocated-check  benchmarks/gpu_colocated_check.py, once it is written                 COLOCATED_CHECK_S=60
#   gpu-multi        benchmarks/gpu_multi.sh (>= 2 GPUs)                                   GPU_MULTI_S=120
#   nemo-rl-grpo     examples/nemo_rl/grpo_refit_check.sh (>= 2 GPUs, NEMO_RL_DIR set)     NEMO_RL_S=600
#
# The last two fit no single GPU (NeMo RL's check puts the policy and vLLM on disjoint
# GPUs); on a machine with more, raise TOTAL_S (say 1500) to give them their limits.
#
# Without a CUDA device (torch.cuda.is_available() false) every check is SKIP and the
# script exits 0. Exit 1 when any check FAILs or hits its TIMEOUT. PYTHON picks the
# interpreter (default python3); GPU_CHECK_ARGS adds arguments to gpu-check (--quick).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTDIR="${1:-${OUT:-$REPO/gpu_checks_out}}"
mkdir -p "$OUTDIR" || exit 2
OUTDIR="$(cd "$OUTDIR" && pwd)"
cd "$REPO" || exit 2
PYTHON="${PYTHON:-python3}"
TOTAL_S="${TOTAL_S:-570}"
KILL_AFTER_S=5
MIN_START_S=10
COLOCATED_CHECK_SCRIPT=benchmarks/gpu_colocated_check.py

export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# The checks call `nemo-refit-reshard`; an uninstalled checkout gets it from here.
BIN="$(mktemp -d)"
trap 'rm -rf "$BIN"' EXIT
if ! command -v nemo-refit-reshard >/dev/null 2>&1; then
    printf '#!/usr/bin/env bash\nexec %q -m nemo_refit_reshard.cli "$@"\n' "$PYTHON" \
        >"$BIN/nemo-refit-reshard"
    chmod +x "$BIN/nemo-refit-reshard"
    export PATH="$BIN:$PATH"
fi

# --- What this machine has -------------------------------------------------------
echo "gpu_checks.sh: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), logs in $OUTDIR, total budget ${TOTAL_S} s"
if command -v nvidia-smi >/dev/null 2>&1; then
    smi="$(timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version \
        --format=csv,noheader 2>&1 | head -8)"
    echo "nvidia-smi: ${smi:-lists no GPU}" | sed '2,$s/^/            /'
else
    echo "nvidia-smi: not found"
fi
declare -A P=()
while IFS='=' read -r key value; do
    [ -n "$key" ] && P[$key]="$value"
done < <(timeout 120 "$PYTHON" - 2>/dev/null <<'EOF'
import importlib.metadata as md
import importlib.util
import platform
import sys

print(f"python={sys.executable} ({platform.python_version()})")
try:
    import torch

    ok = torch.cuda.is_available()
    n = torch.cuda.device_count() if ok else 0
    print(f"torch={torch.__version__} (CUDA {torch.version.cuda}), "
          f"torch.cuda.is_available() {ok}, {n} device(s)")
    print(f"gpus={n}")
    if ok:
        print(f"gpu0={torch.cuda.get_device_name(0)}")
except Exception as e:  # noqa: BLE001
    print(f"torch=not importable ({type(e).__name__}: {e})".replace("\n", " "))
    print("gpus=0")
try:
    import cupy

    usable = bool(cupy.cuda.is_available())
    print(f"cupy={cupy.__version__}, usable {usable}")
    print(f"cupy_ok={int(usable)}")
except Exception as e:  # noqa: BLE001
    print(f"cupy=not importable ({type(e).__name__})")
    print("cupy_ok=0")
for name, dist in (("vllm", "vllm"), ("transformers", "transformers"), ("pytest", "pytest")):
    if importlib.util.find_spec(name) is None:
        print(f"{name}=not installed")
        print(f"{name}_ok=0")
    else:
        try:
            print(f"{name}={md.version(dist)}")
        except md.PackageNotFoundError:
            print(f"{name}=installed (version unknown)")
        print(f"{name}_ok=1")
EOF
)
echo "python: ${P[python]:-$PYTHON did not answer}"
echo "torch: ${P[torch]:-not importable}"
echo "cupy: ${P[cupy]:-?}"
echo "vllm: ${P[vllm]:-?}; transformers: ${P[transformers]:-?}; pytest: ${P[pytest]:-?}"
GPUS="${P[gpus]:-0}"
NO_CUDA=""
[ -n "${P[gpu0]:-}" ] && echo "torch sees: ${P[gpu0]}"
if [ -z "${P[torch]:-}" ] || [[ "${P[torch]}" == "not importable"* ]]; then
    NO_CUDA="no CUDA device: $PYTHON cannot import torch"
elif [ "$GPUS" -lt 1 ]; then
    NO_CUDA="no CUDA device: torch.cuda.is_available() is False"
fi

# --- Running one check -------------------------------------------------------------
NAMES=() STATUS=() SECS=() LOGS=() FIGS=()
record() {  # name status seconds log figure
    NAMES+=("$1") STATUS+=("$2") SECS+=("$3") LOGS+=("$4") FIGS+=("${5//|//}")
}
skip() {  # name reason
    echo "== $1: SKIP ($2)"
    record "$1" SKIP - - "$2"
}
last_line() {
    grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -n 1 | cut -c1-160
}
run_check() {  # name budget headline-function command...
    local name="$1" budget="$2" headline="$3"
    shift 3
    local left=$((TOTAL_S - SECONDS - KILL_AFTER_S))
    if [ "$left" -lt "$MIN_START_S" ]; then
        skip "$name" "total budget of ${TOTAL_S} s spent"
        return
    fi
    local limit=$((budget < left ? budget : left))
    local log="$OUTDIR/$name.log"
    echo "== $name (limit ${limit} s): $*"
    {
        echo "\$ $*"
        echo "limit ${limit} s, started $(date -u '+%H:%M:%S UTC')"
    } >"$log"
    local t0=$SECONDS rc
    timeout --kill-after="$KILL_AFTER_S" "$limit" "$@" >>"$log" 2>&1 </dev/null
    rc=$?
    local took=$((SECONDS - t0)) fig status
    fig="$("$headline" "$log" 2>/dev/null)"
    if [ "$rc" -eq 0 ]; then
        status=PASS
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status=TIMEOUT
        fig="killed at its ${limit} s limit; last line: $(last_line "$log")"
    else
        status=FAIL
        fig="exit $rc; ${fig:-last line: $(last_line "$log")}"
    fi
    echo "   $status in ${took} s"
    record "$name" "$status" "$took" "$log" "${fig:--}"
}

# --- Headline figures, read from each log ----------------------------------------------
head_gpu_check() {  # rows ok, NCCL 1 GiB ratio to a copy, overlapped replay speedup
    awk -F'|' '
        /^\| / && NF >= 6 && $2 !~ /^ (check|---)/ {
            rows++
            gsub(/^ +| +$/, "", $2); gsub(/^ +| +$/, "", $4)
            if ($5 ~ /yes/) ok++; else bad = bad (bad ? ", " : "") $2
            if ($2 ~ /^NCCL self send\/recv/) nccl = $2 ": " $4 "x of a copy"
            if ($2 ~ /^replay inference rank/) replay = "overlapped replay " $4 "x"
        }
        END {
            if (!rows) exit
            out = ok "/" rows " rows ok"
            if (nccl) out = out "; " nccl
            if (replay) out = out "; " replay
            if (bad) out = out "; NO: " bad
            print out
        }' "$1"
}
head_pytest() {  # pytest's closing line
    grep -E '[0-9]+ (passed|failed|error|errors|skipped|deselected)' "$1" | tail -n 1 \
        | sed -E 's/=+//g; s/^ +| +$//g'
}
head_demo() {  # per backend: median refit and check
    awk '
        $1 ~ /^(reshard|broadcast|reshard-colocated)$/ && $3 == "MiB" && NF >= 9 {
            out = out (out ? "; " : "") $1 " " $4 " " $5 " " $NF
        }
        END { if (out) print out }' "$1"
}
head_vllm() {  # per model: tokens equal, max |dlogprob|, pointers, refit seconds
    awk '
        $1 ~ /^qwen/ && NF >= 6 {
            out = out (out ? "; " : "") $1 ": tokens equal " $2 ", max dlogp " $3 \
                ", ptrs same " $4 ", refit " $5 " s"
        }
        END { if (out) print out }' "$1"
}
head_ipc() {  # rows ok, and what was skipped (the reversed order on one GPU)
    awk -F'|' '
        /^\| / && NF >= 6 && $2 !~ /^ (check|---)/ {
            rows++
            gsub(/^ +| +$/, "", $2); gsub(/^ +| +$/, "", $3)
            if ($5 ~ /yes/) ok++; else bad = bad (bad ? ", " : "") $2
            if ($3 ~ /^skipped/) skipped = skipped "; SKIP " $2 " (" $3 ")"
        }
        END {
            if (!rows) exit
            out = ok "/" rows " rows ok" skipped
            if (bad) out = out "; NO: " bad
            print out
        }' "$1"
}
head_last() { last_line "$1"; }

# --- The checks ----------------------------------------------------------------------------
mapfile -t GPU_TESTS < <(grep -l 'pytest.mark.gpu' tests/test_*.py 2>/dev/null)

if [ -n "$NO_CUDA" ]; then
    skip gpu-check "$NO_CUDA"
elif [ "${P[cupy_ok]:-0}" != 1 ]; then
    skip gpu-check "needs CuPy (pip install -e '.[gpu]'): ${P[cupy]:-not importable}"
else
    # shellcheck disable=SC2086  # GPU_CHECK_ARGS: words on purpose
    run_check gpu-check "${GPU_CHECK_S:-180}" head_gpu_check \
        "$PYTHON" -m nemo_refit_reshard.cli gpu-check ${GPU_CHECK_ARGS:-}
fi

if [ -n "$NO_CUDA" ]; then
    skip pytest-gpu "$NO_CUDA"
elif [ "${P[pytest_ok]:-0}" != 1 ]; then
    skip pytest-gpu "needs pytest"
elif [ "${#GPU_TESTS[@]}" -eq 0 ]; then
    skip pytest-gpu "no test marked gpu under tests/"
else
    run_check pytest-gpu "${PYTEST_GPU_S:-60}" head_pytest \
        "$PYTHON" -m pytest -q -rs -p no:cacheprovider -m gpu "${GPU_TESTS[@]}"
fi

if [ -n "$NO_CUDA" ]; then
    skip colocated-demo "$NO_CUDA"
else
    run_check colocated-demo "${COLOCATED_DEMO_S:-90}" head_demo \
        "$PYTHON" -m nemo_refit_reshard.cli demo --colocated --device cuda --timeout 60
fi

# One GPU: the UUID round trip and an open with the same visible GPUs (the reversed
# order is a row that says it was skipped); two or more: the reversed order too.
if [ -n "$NO_CUDA" ]; then
    skip ipc-devices "$NO_CUDA"
else
    run_check ipc-devices "${IPC_DEVICES_S:-30}" head_ipc \
        "$PYTHON" -m nemo_refit_reshard.cli.ipc_check cuda
fi

if [ -n "$NO_CUDA" ]; then
    skip vllm-check "$NO_CUDA"
elif [ "${P[vllm_ok]:-0}" != 1 ] || [ "${P[transformers_ok]:-0}" != 1 ]; then
    skip vllm-check "needs a GPU install of vLLM and transformers (vllm: ${P[vllm]:-?}, transformers: ${P[transformers]:-?})"
else
    run_check vllm-check "${VLLM_CHECK_S:-180}" head_vllm \
        "$PYTHON" benchmarks/gpu_vllm_check.py
fi

if [ ! -f "$COLOCATED_CHECK_SCRIPT" ]; then
    skip colocated-check "not written yet ($COLOCATED_CHECK_SCRIPT)"
elif [ -n "$NO_CUDA" ]; then
    skip colocated-check "$NO_CUDA"
else
    run_check colocated-check "${COLOCATED_CHECK_S:-60}" head_last \
        "$PYTHON" "$COLOCATED_CHECK_SCRIPT"
fi

if [ -n "$NO_CUDA" ]; then
    skip gpu-multi "$NO_CUDA"
elif [ "$GPUS" -lt 2 ]; then
    skip gpu-multi "needs 2 GPUs ($GPUS found)"
elif [ "${P[cupy_ok]:-0}" != 1 ]; then
    skip gpu-multi "needs CuPy (pip install -e '.[gpu]')"
else
    run_check gpu-multi "${GPU_MULTI_S:-120}" head_demo bash benchmarks/gpu_multi.sh
fi

# NeMo RL's GRPO refit check puts the Megatron policy and vLLM on disjoint GPUs (and
# needs NeMo RL's environment and Qwen3-0.6B from the hub): no part of it fits one GPU.
if [ -n "$NO_CUDA" ]; then
    skip nemo-rl-grpo "$NO_CUDA"
elif [ "$GPUS" -lt 2 ]; then
    skip nemo-rl-grpo "needs 2 GPUs ($GPUS found)"
elif [ -z "${NEMO_RL_DIR:-}" ]; then
    skip nemo-rl-grpo "set NEMO_RL_DIR to a NeMo RL checkout with its environment"
else
    # Its own OUT is where it writes (and first removes): never ours.
    run_check nemo-rl-grpo "${NEMO_RL_S:-600}" head_last \
        env OUT="$OUTDIR/nemo-rl-grpo" GPUS="$GPUS" bash examples/nemo_rl/grpo_refit_check.sh
fi

# --- The table ---------------------------------------------------------------------------
failed=0
{
    echo
    echo "GPU checks: ${SECONDS} s in all (budget ${TOTAL_S} s)"
    echo "| check | status | seconds | log | figure / reason |"
    echo "|---|---|---|---|---|"
    for i in "${!NAMES[@]}"; do
        echo "| ${NAMES[$i]} | ${STATUS[$i]} | ${SECS[$i]} | ${LOGS[$i]} | ${FIGS[$i]} |"
    done
} | tee "$OUTDIR/summary.md"
for s in "${STATUS[@]}"; do
    case "$s" in FAIL | TIMEOUT) failed=1 ;; esac
done
exit "$failed"
