# Sourced by ci/demo.sh and ci/test.sh, from the clone's root: the project's virtual
# environment, .venv (DASK_OVERLAP_VENV to put it elsewhere), made with `python3 -m venv`
# when missing. Everything is installed there, never into the system's Python: Debian's
# refuses pip (externally-managed-environment), and as root pip would change the system.
# Sets PY, the environment's interpreter. PYTHON picks the Python that makes it (3.11+).
VENV=${DASK_OVERLAP_VENV:-.venv}
if ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    maker=${PYTHON:-python3}
    if ! "$maker" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "ci: dask_overlap needs Python 3.11 or newer; $maker is" \
            "$("$maker" --version 2>&1 || echo missing) (set PYTHON=python3.11, say)" >&2
        exit 1
    fi
    echo "ci: making the virtual environment $VENV with $("$maker" --version 2>&1)" >&2
    rm -rf "$VENV"  # a half-made one (no pip) from an earlier failed attempt
    if ! "$maker" -m venv "$VENV"; then
        rm -rf "$VENV"
        echo "ci: $maker -m venv failed; on Debian or Ubuntu: apt-get install python3-venv" >&2
        exit 1
    fi
fi
PY=$VENV/bin/python
