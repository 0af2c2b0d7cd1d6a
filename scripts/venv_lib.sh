# shellcheck shell=bash
# Shared by the setup_*_cpu.sh scripts (sourced, not run): a venv over the packages of
# the environment the tests run in, pip pinned to its CPU torch, output shown only on
# failure.
#
#   installed PY PACKAGE       -> the version of PACKAGE in PY, or nothing
#   resolve_python VAR VALUE   -> the path of the interpreter VALUE names (a path, or a
#                                 name such as python3.12); one-line error naming VAR
#                                 and exit 1 when there is none
#   venv_matches VENV          -> true when VENV is a venv that make_venv would make now
#   make_venv VENV             -> creates VENV over the running environment (below),
#                                 replacing one made for another; sets PY and PIP
#   use_venv VENV              -> sets PY and PIP for an existing VENV
#   quiet CMD...               -> runs CMD, printing its output only if it fails
#   is_done VENV WHAT          -> true when VENV matches and its last setup of WHAT
#                                 (e.g. vllm-0.33.0) finished with these scripts
#   mark_done VENV WHAT        -> records that, after the setup's last check passed
#
# The running environment is the one of `python3` on PATH, the interpreter that runs the
# tests: the user's venv, a conda environment or the system Python, wherever this
# project and torch were installed. The framework venv is made from it and sees its
# packages: with --system-site-packages when it is the system Python or a conda
# environment (its site-packages are the "system" ones); when it is a venv, through a
# .pth file in the framework venv that adds the running venv's site-packages (with
# their own .pth files, e.g. an editable install) -- --system-site-packages would only
# reach the base interpreter under it, where torch may not be -- and with the system
# site as well only when the running venv itself sees it. The framework venv's own
# packages (vLLM, veRL's transformers pin) come first on sys.path.
#
# A venv made for another running environment (another venv, the system Python after a
# venv) sees the wrong packages: venv_matches says so, and make_venv removes it and
# builds it again, saying so in one line.
#
# VENV_PYTHON=python3.12 or /path/to/python (optional; a name is looked up on PATH, then
# through pyenv): make_venv builds an isolated venv on that interpreter instead (no system
# site packages: the running environment's packages are built for python3 and do not load
# on another Python) and installs into it the torch version of python3, with numpy. Where
# no CPU wheel of that torch exists for the interpreter, pip takes the default (CUDA)
# build from the package index: about 2.6 GB with its nvidia-* libraries; it runs on CPU.
# An existing VENV that is not an isolated venv of that interpreter is refused, not
# replaced (it took ~10 minutes to build).

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
        # pyenv's version directories have plain names: ls is safe here.
        # shellcheck disable=SC2012
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

# The running environment, one item a line: whether python3 runs inside a venv (1/0),
# whether it sees the system site-packages (1/0), its purelib and platlib directories.
running_env() {
    python3 - <<'PYEOF'
import os
import sys
import sysconfig

in_venv = sys.prefix != sys.base_prefix
sees_system = not in_venv
if in_venv:
    with open(os.path.join(sys.prefix, "pyvenv.cfg")) as cfg:
        for line in cfg:
            key, _, value = line.partition("=")
            if key.strip() == "include-system-site-packages":
                sees_system = value.strip().lower() == "true"
paths = sysconfig.get_paths()
print(int(in_venv), int(sees_system), paths["purelib"], paths["platlib"], sep="\n")
PYEOF
}

venv_matches() {
    [ -x "$1/bin/python" ] || return 1
    if [ -n "${VENV_PYTHON:-}" ]; then
        local want have
        want="$("$VENV_PYTHON" -c 'import sys; print(sys.version)')"
        have="$("$1/bin/python" -c 'import sys; print(sys.version)' 2>/dev/null || true)"
        [ "$want" = "$have" ] && grep -qx 'include-system-site-packages = false' "$1/pyvenv.cfg"
        return
    fi
    # Same base interpreter as python3, and python3's site-packages on the venv's path.
    python3 - "$1/bin/python" <<'PYEOF'
import os
import subprocess
import sys
import sysconfig

probe = "import sys; print(sys.base_prefix); print(*sys.path, sep='\\n')"
done = subprocess.run([sys.argv[1], "-c", probe], capture_output=True, text=True)
base, *path = done.stdout.splitlines() or [""]
same_base = os.path.realpath(base) == os.path.realpath(sys.base_prefix)
sees = os.path.realpath(sysconfig.get_paths()["purelib"]) in map(os.path.realpath, path)
sys.exit(0 if done.returncode == 0 and same_base and sees else 1)
PYEOF
}

make_venv() {
    if [ -n "${VENV_PYTHON:-}" ]; then
        VENV_PYTHON="$(resolve_python VENV_PYTHON "$VENV_PYTHON")"
        # Re-running venv over a venv of another interpreter would leave the old one's
        # site-packages behind (and the scripts' "already installed" checks would look there).
        if [ -e "$1/pyvenv.cfg" ] && ! venv_matches "$1"; then
            echo "$1 exists and is not an isolated venv of $VENV_PYTHON: remove it or pick another" >&2
            exit 1
        fi
        "$VENV_PYTHON" -m venv "$1"
    else
        if [ -e "$1/pyvenv.cfg" ] && ! venv_matches "$1"; then
            # Re-running venv over it would keep the old packages and the old view.
            echo "$1 was made for another Python environment than $(command -v python3): rebuilding it"
            rm -rf "$1"
        fi
        local env in_venv sees_system purelib platlib
        env="$(running_env)"
        { read -r in_venv; read -r sees_system; read -r purelib; read -r platlib; } <<<"$env"
        if [ "$sees_system" = 1 ]; then
            python3 -m venv --system-site-packages "$1"
        else
            python3 -m venv "$1"
        fi
        if [ "$in_venv" = 1 ]; then
            # A .pth line that starts with `import` runs at startup; addsitedir also runs
            # the .pth files found there (an editable install's finder, for one).
            local own
            own="$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
            printf 'import site; site.addsitedir(%s); site.addsitedir(%s)\n' \
                "$(python3 -c 'import sys; print(repr(sys.argv[1]))' "$purelib")" \
                "$(python3 -c 'import sys; print(repr(sys.argv[1]))' "$platlib")" \
                >"$own/_nrr_running_env.pth"
        fi
    fi
    use_venv "$1"
}

use_venv() {
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

# A setup that finished leaves a stamp in the venv: what it installed and a hash of the
# scripts that did it. A venv with a matching stamp is kept as it is (no pip, no import
# check: a few seconds); a missing or different stamp (a build that stopped half way, a
# venv of an older script) re-runs the setup over the venv, which pip makes quick for
# what is already there.
stamp() {
    echo "$1 $(cat "$(dirname "${BASH_SOURCE[0]}")/venv_lib.sh" "$0" | sha256sum | cut -c1-16)"
}
is_done() {
    venv_matches "$1" && [ "$(cat "$1/.nrr-setup-${2%%-*}" 2>/dev/null)" = "$(stamp "$2")" ]
}
mark_done() { stamp "$2" >"$1/.nrr-setup-${2%%-*}"; }

quiet() { "$@" >"$LOG" 2>&1 || { cat "$LOG"; exit 1; }; }
