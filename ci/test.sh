#!/usr/bin/env bash
# Installs dask_overlap with its test dependencies and runs the test suite (CPU; the
# GPU tests are collected and skipped where no GPU is visible: run them with -m gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check -e ".[test]"
# The browser test of the dashboard needs Debian's chromium (skipped without it).
# Set SKIP_CHROMIUM=1 not to install it (the browser test is then skipped, with its reason).
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && [ -z "${SKIP_CHROMIUM:-}" ]; then
    echo "ci/test.sh: installing Debian's chromium (apt-get, as root) for the test that opens" \
        "the /overlap page in a headless browser; SKIP_CHROMIUM=1 skips this" >&2
    # Not fatal: without it the browser test is skipped, with its reason, and the rest runs.
    { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } ||
        echo "ci/test.sh: could not install chromium; the browser test will be skipped" >&2
fi
exec python3 -m pytest -q -p no:cacheprovider "$@"
