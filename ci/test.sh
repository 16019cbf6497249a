#!/usr/bin/env bash
# Installs dask_overlap with its test extra (pytest, the dashboard's bokeh, SciPy and Zarr
# for the example, Sphinx for the docs) into the project's virtual environment (.venv, made
# if missing; see ci/venv.sh) and runs the test suite there. The GPU tests are collected and
# skipped where no GPU is visible (run them with -m gpu). Arguments go to pytest.
#
# As root, and when chromium is missing, it also installs Debian's chromium with apt-get
# (about 30 s; it changes the system) for the one test that opens the /overlap page in a
# headless browser. SKIP_CHROMIUM=1 skips that: the browser test is then skipped, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/venv.sh
echo "ci/test.sh: installing dask_overlap[test] into $VENV" >&2
"$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && [ -z "${SKIP_CHROMIUM:-}" ]; then
    echo "ci/test.sh: installing Debian's chromium (apt-get, as root) for the test that opens" \
        "the /overlap page in a headless browser; SKIP_CHROMIUM=1 skips this" >&2
    # Not fatal: without it the browser test is skipped, with its reason, and the rest runs.
    { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } ||
        echo "ci/test.sh: could not install chromium; the browser test will be skipped" >&2
fi
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
