# Shared by the setup_*_cpu.sh scripts (sourced, not run): a venv over this machine's
# packages, pip pinned to the installed CPU torch, output shown only on failure.
#
#   installed PY PACKAGE       -> the version of PACKAGE in PY, or nothing
#   resolve_python VAR VALUE   -> the path of the interpreter VALUE names (a path, or a
#                                 name such as python3.12); one-line error naming VAR
#                                 and exit 1 when there is none
#   make_venv VENV             -> creates VENV (--system-site-packages); sets PY and PIP
#   quiet CMD...               -> runs CMD, printing its output only if it fails
#
# VENV_PYTHON=python3.12 or /path/to/python (optional; a name is looked up on PATH, then
# through pyenv): make_venv builds an isolated venv on that interpreter instead (no system
# site packages: this machine's packages are built for python3 and do not load on another
# Python) and installs into it the torch version of python3, with numpy. Where no CPU
# wheel of that torch exists for the interpreter, pip takes the default (CUDA) build from
# the package index: about 2.6 GB with its nvidia-* libraries; it runs on CPU.

installed() {
    [ -x "$1" ] && "$1" -c "from importlib.metadata import version; print(version('$2'))" 2>/dev/null
}

# True when "$1" names an interpreter that starts (a pyenv shim of a version that is not
# selected exists on PATH but exits 127).
runs_python() { [ -n "$1" ] && "$1" -c 'import sys' >/dev/null 2>&1; }

resolve_python() {
    local var="$1" want="$2" name="${2##*/}" candidate found="" root
    if [[ "$want" == */* ]]; then
        candidate="$want"
    else
        candidate="$(command -v "$want" || true)"
    fi
    runs_python "$candidate" && found="$candidate"
    # A path that is not a pyenv shim is taken as given, never swapped for another Python.
    if [ -z "$found" ] && [[ "$want" == */* && "$want" != */shims/* ]]; then
        echo "error: $var=$want does not run" >&2
        exit 1
    fi
    # pyenv: its shim runs a name only from the selected versions; `pyenv which` knows
    # the selection, its versions directory has every installed one (highest first
    # wins; only version-named entries, not pyenv-virtualenv environments).
    if [ -z "$found" ] && command -v pyenv >/dev/null 2>&1; then
        candidate="$(pyenv which "$name" 2>/dev/null || true)"
        runs_python "$candidate" && found="$candidate"
    fi
    if [ -z "$found" ]; then
        root="$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")"
        while read -r candidate; do
            runs_python "$candidate" && found="$candidate" && break
        done < <(ls -d "$root"/versions/[0-9]*/bin/"$name" 2>/dev/null | sort -rV)
    fi
    if [ -z "$found" ]; then
        echo "error: $var=$want: no such Python (not a runnable path, not on PATH, not in pyenv's versions); give the interpreter's full path" >&2
        exit 1
    fi
    # The interpreter itself, not a shim whose choice depends on the directory it runs in.
    "$found" -c 'import sys; print(sys.executable)'
}

make_venv() {
    if [ -n "${VENV_PYTHON:-}" ]; then
        VENV_PYTHON="$(resolve_python VENV_PYTHON "$VENV_PYTHON")"
        # Re-running venv over a venv of another interpreter would leave the old one's
        # site-packages behind (and the scripts' "already installed" checks would look there).
        if [ -e "$1/pyvenv.cfg" ]; then
            local want have
            want="$("$VENV_PYTHON" -c 'import sys; print(sys.version)')"
            have="$("$1/bin/python" -c 'import sys; print(sys.version)' 2>/dev/null || true)"
            if [ "$want" != "$have" ] || ! grep -qx 'include-system-site-packages = false' "$1/pyvenv.cfg"; then
                echo "$1 exists and is not an isolated venv of $VENV_PYTHON: remove it or pick another" >&2
                exit 1
            fi
        fi
        "$VENV_PYTHON" -m venv "$1"
    else
        python3 -m venv --system-site-packages "$1"
    fi
    PY="$1/bin/python"
    local torch
    torch="$(python3 -c 'import torch; print(torch.__version__.split("+")[0])')"
    CONSTRAINTS="$(mktemp)"
    LOG="$(mktemp)"
    trap 'rm -f "$CONSTRAINTS" "$LOG"' EXIT
    echo "torch==$torch" > "$CONSTRAINTS"
    PIP=("$PY" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS")
    local have_torch
    have_torch="$(installed "$PY" torch || true)"
    if [ -n "${VENV_PYTHON:-}" ] && [ "${have_torch%%+*}" != "$torch" ]; then
        echo "installing torch $torch into $1 ($("$PY" --version); may download ~2.6 GB)"
        quiet "${PIP[@]}" "torch==$torch" numpy
    fi
}

quiet() { "$@" >"$LOG" 2>&1 || { cat "$LOG"; exit 1; }; }
