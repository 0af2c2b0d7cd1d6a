# Shared by the setup_*_cpu.sh scripts (sourced, not run): a venv over this machine's
# packages, pip pinned to the installed CPU torch, output shown only on failure.
#
#   installed PY PACKAGE       -> the version of PACKAGE in PY, or nothing
#   make_venv VENV             -> creates VENV (--system-site-packages); sets PY and PIP
#   quiet CMD...               -> runs CMD, printing its output only if it fails

installed() {
    [ -x "$1" ] && "$1" -c "from importlib.metadata import version; print(version('$2'))" 2>/dev/null
}

make_venv() {
    python3 -m venv --system-site-packages "$1"
    PY="$1/bin/python"
    local torch
    torch="$(python3 -c 'import torch; print(torch.__version__.split("+")[0])')"
    CONSTRAINTS="$(mktemp)"
    LOG="$(mktemp)"
    trap 'rm -f "$CONSTRAINTS" "$LOG"' EXIT
    echo "torch==$torch" > "$CONSTRAINTS"
    PIP=("$PY" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS")
}

quiet() { "$@" >"$LOG" 2>&1 || { cat "$LOG"; exit 1; }; }
