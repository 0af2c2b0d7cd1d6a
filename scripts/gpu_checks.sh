#!/usr/bin/env bash
# shellcheck disable=SC2317  # the head_* and verdict_* functions are called by name
# Every GPU check of the project in one run, on one GPU, within 8 minutes (one H100
# 80 GB or H200), then one summary table. Run from anywhere; it works in the repository
# root:
#
#   bash scripts/gpu_checks.sh [OUTDIR]      # default $OUT if set, else <repo>/gpu_checks_out/
#
# Each check runs under its own wall-clock limit (`timeout`, seconds below; override
# with the variable named), its whole output in OUTDIR/<check>.log; a failure never
# stops the run. The one-GPU limits add up to 460 s and TOTAL_S (470 s) caps the run: a
# check gets at most what is left of it.
#
#   install         INSTALL_S=45         pip install --no-deps -e . (quiet; offline first)
#   gpu-check       GPU_CHECK_S=95       nemo-refit-reshard gpu-check: NCCL self send/recv,
#                                        pack/unpack against the device's copy peak,
#                                        overlapped replay, bit-exact (--quick on cards
#                                        under 100 GB, chosen by gpu-check itself)
#   pytest-gpu      PYTEST_GPU_S=125     the tests marked gpu (pytest -m gpu): CUDA programs,
#                                        FP8 quantization and the delta codec equal to CPU,
#                                        CUDA IPC staging under expandable segments, a CUDA
#                                        graph over refitted derived tensors, ...
#   colocated-demo  COLOCATED_DEMO_S=75  demo --colocated --device cuda: every training/
#                                        inference pair on the one GPU, staging shared by
#                                        CUDA IPC, and gloo through pinned copies, bit-exact
#   ipc-devices     IPC_DEVICES_S=60     cli/ipc_check.py: a staging exported by one process,
#                                        opened by a second (same GPU by UUID, same bytes,
#                                        nothing left in /dev/shm), the exporter also under
#                                        expandable_segments:True
#   gloo-cuda       GLOO_CUDA_S=60       demo --device cuda, tp=1 -> tp=1: two processes, CUDA
#                                        tensors over gloo through pinned host copies
#                                        (engine/host_staged.py), bit-exact
#   vllm-check      VLLM_CHECK_S=180     benchmarks/gpu_vllm_check.py: a real vllm.LLM refit
#   gpu-multi       GPU_MULTI_S=120      benchmarks/gpu_multi.sh (>= 2 GPUs)
#   nemo-rl-grpo    NEMO_RL_S=600        examples/nemo_rl/grpo_refit_check.sh (>= 2 GPUs,
#                                        NEMO_RL_DIR set)
#
# Every row is PASS, FAIL or SKIP. SKIP only where the check cannot run here and that is
# no fault: no CUDA device (every row: run on a machine without a GPU, the script exits
# 0), one GPU where two are needed, vLLM not installed, NEMO_RL_DIR not set. A dependency
# missing while CUDA is present (CuPy, pytest, transformers beside vLLM) is a FAIL; so is
# a check killed at its limit or left without time, a pytest run in which no test passed
# (all skipped, or none selected), and a GPU that nvidia-smi lists while torch sees none
# (CUDA_VISIBLE_DEVICES unset). Exit 1 when any row is FAIL. PYTHON picks the
# interpreter (default python3); GPU_CHECK_ARGS gives gpu-check's arguments (default
# --quick: the DeepSeek-V3-scale --full run plans for ~50 s and moves ~40 GiB per rank,
# past its limit here; set GPU_CHECK_ARGS=--full with a larger GPU_CHECK_S for it). The last two checks fit no single GPU; with more, raise TOTAL_S (say 1300).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUTDIR="${1:-${OUT:-$REPO/gpu_checks_out}}"
mkdir -p "$OUTDIR" || exit 2
OUTDIR="$(cd "$OUTDIR" && pwd)"
cd "$REPO" || exit 2
PYTHON="${PYTHON:-python3}"
TOTAL_S="${TOTAL_S:-470}"
KILL_AFTER_S=5
MIN_START_S=10

export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

# --- What this machine has -------------------------------------------------------
echo "gpu_checks.sh: $(date -u '+%Y-%m-%d %H:%M:%S UTC')," \
    "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')," \
    "logs in $OUTDIR, total budget ${TOTAL_S} s"
LISTED=""
if command -v nvidia-smi >/dev/null 2>&1; then
    smi="$(timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version \
        --format=csv,noheader 2>&1 | head -8)" && LISTED="$(head -n 1 <<<"$smi" | cut -d, -f1)"
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

    # The transport's own test: a device, and NCCL's library (CuPy imports without it).
    from nemo_refit_reshard.engine.cupy_nccl import cupy_unavailable_reason

    why = cupy_unavailable_reason()
    note = "" if why is None else f" ({why})".replace("\n", " ")
    print(f"cupy={cupy.__version__}, usable {why is None}{note}")
    print(f"cupy_ok={int(why is None)}")
except Exception as e:  # noqa: BLE001
    print(f"cupy=not importable ({type(e).__name__})")
    print("cupy_ok=0")
for name in ("vllm", "transformers", "pytest", "numba"):
    if importlib.util.find_spec(name) is None:
        print(f"{name}=not installed")
        print(f"{name}_ok=0")
    else:
        try:
            print(f"{name}={md.version(name)}")
        except md.PackageNotFoundError:
            print(f"{name}=installed (version unknown)")
        print(f"{name}_ok=1")
EOF
)
echo "python: ${P[python]:-$PYTHON did not answer}"
echo "torch: ${P[torch]:-not importable}"
echo "cupy: ${P[cupy]:-?}"
echo "vllm: ${P[vllm]:-?}; transformers: ${P[transformers]:-?};" \
    "pytest: ${P[pytest]:-?}; numba: ${P[numba]:-?}"
GPUS="${P[gpus]:-0}"
NO_CUDA=""
[ -n "${P[gpu0]:-}" ] && echo "torch sees: ${P[gpu0]}"
if [ -z "${P[torch]:-}" ] || [[ "${P[torch]}" == "not importable"* ]]; then
    NO_CUDA="no CUDA device: $PYTHON cannot import torch"
elif [ "$GPUS" -lt 1 ]; then
    NO_CUDA="no CUDA device: torch.cuda.is_available() is False"
fi
# A GPU this process may use (nothing hides it) that torch cannot: a broken install.
BROKEN=""
if [ -n "$NO_CUDA" ] && [ -n "$LISTED" ] && [ -z "${CUDA_VISIBLE_DEVICES+set}" ]; then
    BROKEN="nvidia-smi lists $LISTED but ${NO_CUDA#no CUDA device: } (torch: ${P[torch]:-?})"
fi

# --- Rows --------------------------------------------------------------------------
NAMES=() STATUS=() SECS=() LOGS=() FIGS=()
record() {  # name status seconds log figure
    NAMES+=("$1") STATUS+=("$2") SECS+=("$3") LOGS+=("$4") FIGS+=("${5//|//}")
}
skip() {  # name reason
    echo "== $1: SKIP ($2)"
    record "$1" SKIP - - "$2"
}
fail() {  # name reason
    echo "== $1: FAIL ($2)"
    record "$1" FAIL - - "$2"
}
cuda_or_row() {  # name: 0 when CUDA is usable; else its row (SKIP, or FAIL if broken)
    if [ -n "$BROKEN" ]; then
        fail "$1" "$BROKEN"
    elif [ -n "$NO_CUDA" ]; then
        skip "$1" "$NO_CUDA"
    else
        return 0
    fi
    return 1
}
needs() {  # name flag what: 0 when the dependency is there; else a FAIL row
    [ "$2" = 1 ] && return 0
    fail "$1" "$3"
    return 1
}
last_line() {
    grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -n 1 | cut -c1-160
}
run_check() {  # name budget headline verdict command...
    local name="$1" budget="$2" headline="$3" verdict="$4"
    shift 4
    local left=$((TOTAL_S - SECONDS - KILL_AFTER_S))
    if [ "$left" -lt "$MIN_START_S" ]; then
        fail "$name" "not run: the total budget of ${TOTAL_S} s was spent"
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
    local took=$((SECONDS - t0)) fig status judged=""
    fig="$("$headline" "$log" 2>/dev/null)"
    [ "$verdict" != - ] && judged="$("$verdict" "$log" "$rc")"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status=FAIL
        fig="timed out: killed at its ${limit} s limit; last line: $(last_line "$log")"
    elif [ -n "$judged" ]; then
        status="${judged%% *}"
        fig="${judged#* }"
    elif [ "$rc" -eq 0 ]; then
        status=PASS
    else
        status=FAIL
        fig="exit $rc; ${fig:-last line: $(last_line "$log")}"
    fi
    echo "   $status in ${took} s"
    record "$name" "$status" "$took" "$log" "${fig:--}"
}

# --- Headline figures and verdicts, read from each log ---------------------------------
head_gpu_check() {  # rows ok, the size run, NCCL 1 GiB / pack / unpack against a copy, replay
    awk -F'|' '
        /^gpu-check: --quick chosen/ { size = "quick (auto)" }
        /^gpu-check on / { if (!size) size = ($0 ~ /\(quick\)/) ? "quick" : "full" }
        /^\| / && NF >= 6 && $2 !~ /^ (check|---)/ {
            rows++
            gsub(/^ +| +$/, "", $2); gsub(/^ +| +$/, "", $4)
            if ($5 ~ /yes/) ok++; else bad = bad (bad ? ", " : "") $2
            if ($2 ~ /^NCCL self send\/recv/) nccl = $2 ": " $4 "x of a copy"
            if ($2 ~ /^(pack|unpack), /)
                copy = copy (copy ? ", " : "") $2 " " $4 "x of the copy peak"
            if ($2 ~ /^replay inference rank/) replay = "overlapped replay " $4 "x"
        }
        END {
            if (!rows) exit
            out = ok "/" rows " rows ok" (size ? " (" size ")" : "")
            if (nccl) out = out "; " nccl
            if (copy) out = out "; " copy
            if (replay) out = out "; " replay
            if (bad) out = out "; NO: " bad
            print out
        }' "$1"
}
head_pytest() {  # pytest's closing line
    grep -E '([0-9]+ (passed|failed|error|errors|skipped|deselected))|no tests ran' "$1" \
        | tail -n 1 | sed -E 's/=+//g; s/^ +| +$//g'
}
verdict_pytest() {  # log rc: FAIL unless at least one test passed (pytest exit 5: none ran)
    local summary passed
    summary="$(head_pytest "$1")"
    passed="$(grep -oE '[0-9]+ passed' <<<"$summary" | grep -oE '[0-9]+')"
    if [ "$2" -eq 5 ]; then
        echo "FAIL pytest selected no test: ${summary:-no summary line}"
    elif [ "$2" -eq 0 ] && [ "${passed:-0}" -eq 0 ]; then
        echo "FAIL no test passed: ${summary:-no summary line}"
    fi
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
            if ($3 ~ /^skipped/) skipped = skipped "; not run: " $2 " (" $3 ")"
        }
        END {
            if (!rows) exit
            out = ok "/" rows " rows ok" skipped
            if (bad) out = out "; NO: " bad
            print out
        }' "$1"
}
head_last() { last_line "$1"; }

# --- The checks ------------------------------------------------------------------------
# Offline first (no index, no build isolation: setuptools from this environment), then
# pip's default (an index, where the machine reaches one).
INSTALL='"$0" -m pip install -q --no-deps --no-index --no-build-isolation -e . ||
    "$0" -m pip install -q --no-deps --timeout 5 --retries 0 -e .'
if cuda_or_row install; then
    run_check install "${INSTALL_S:-45}" head_last - bash -c "$INSTALL" "$PYTHON"
fi

CUPY_MISSING="needs CuPy (pip install -e '.[gpu]'): ${P[cupy]:-not importable}"
if cuda_or_row gpu-check && needs gpu-check "${P[cupy_ok]:-0}" "$CUPY_MISSING"; then
    # shellcheck disable=SC2086  # GPU_CHECK_ARGS: words on purpose
    run_check gpu-check "${GPU_CHECK_S:-95}" head_gpu_check - \
        "$PYTHON" -m nemo_refit_reshard.cli gpu-check ${GPU_CHECK_ARGS:---quick}
fi

# gpu-check's own quick run is the gpu-check row: not run twice.
mapfile -t GPU_TESTS < <(grep -l 'pytest.mark.gpu' tests/test_*.py 2>/dev/null)
if cuda_or_row pytest-gpu &&
    needs pytest-gpu "${P[pytest_ok]:-0}" "needs pytest: ${P[pytest]:-not importable}"; then
    run_check pytest-gpu "${PYTEST_GPU_S:-125}" head_pytest verdict_pytest \
        "$PYTHON" -m pytest -q -rs -p no:cacheprovider -m gpu \
        --deselect tests/test_gpu.py::test_gpu_check_quick_passes "${GPU_TESTS[@]}"
fi

if cuda_or_row colocated-demo; then
    run_check colocated-demo "${COLOCATED_DEMO_S:-75}" head_demo - \
        "$PYTHON" -m nemo_refit_reshard.cli demo --colocated --device cuda --timeout 60
fi

# One GPU: the UUID round trip, an open with the same visible GPUs and one with the
# exporter under expandable segments (the reversed order is a row that says it was not
# run); two or more: the reversed order too.
if cuda_or_row ipc-devices; then
    run_check ipc-devices "${IPC_DEVICES_S:-60}" head_ipc - \
        "$PYTHON" -m nemo_refit_reshard.cli.ipc_check cuda
fi

if cuda_or_row gloo-cuda; then
    run_check gloo-cuda "${GLOO_CUDA_S:-60}" head_demo - \
        "$PYTHON" -m nemo_refit_reshard.cli demo --device cuda --train tp=1 --infer tp=1 \
        --timeout 45
fi

if ! cuda_or_row vllm-check; then
    :
elif [ "${P[vllm_ok]:-0}" != 1 ]; then
    skip vllm-check "vLLM is not installed (a GPU install of vllm and transformers runs it)"
elif needs vllm-check "${P[transformers_ok]:-0}" "needs transformers beside vLLM ${P[vllm]:-}"; then
    run_check vllm-check "${VLLM_CHECK_S:-180}" head_vllm - \
        "$PYTHON" benchmarks/gpu_vllm_check.py
fi

if ! cuda_or_row gpu-multi; then
    :
elif [ "$GPUS" -lt 2 ]; then
    skip gpu-multi "needs 2 GPUs ($GPUS found)"
elif needs gpu-multi "${P[cupy_ok]:-0}" "$CUPY_MISSING"; then
    run_check gpu-multi "${GPU_MULTI_S:-120}" head_demo - bash benchmarks/gpu_multi.sh
fi

# NeMo RL's GRPO refit check puts the Megatron policy and vLLM on disjoint GPUs (and
# needs NeMo RL's environment and Qwen3-0.6B from the hub): no part of it fits one GPU.
if ! cuda_or_row nemo-rl-grpo; then
    :
elif [ "$GPUS" -lt 2 ]; then
    skip nemo-rl-grpo "needs 2 GPUs ($GPUS found)"
elif [ -z "${NEMO_RL_DIR:-}" ]; then
    skip nemo-rl-grpo "set NEMO_RL_DIR to a NeMo RL checkout with its environment"
else
    # Its own OUT is where it writes (and first removes): never ours.
    run_check nemo-rl-grpo "${NEMO_RL_S:-600}" head_last - \
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
    [ "$s" = FAIL ] && failed=1
done
exit "$failed"
