#!/usr/bin/env bash
# Installs dask_overlap into the project's virtual environment (.venv, made if missing; see
# ci/venv.sh), with CuPy and RMM when an NVIDIA GPU is visible, and runs the demo on a local
# cluster: on the GPU if there is one, on the CPU path otherwise. Arguments go to the demo
# (bash ci/demo.sh --help lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/venv.sh
extra=""
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  cuda=$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p' | head -n 1)
  if [ "${cuda:-13}" -ge 13 ]; then extra="cuda13,"; else extra="cuda12,"; fi
fi
# The dashboard extra: the demo links its /overlap page, which needs bokeh.
echo "ci/demo.sh: installing dask_overlap[${extra}dashboard] into $VENV" >&2
"$PY" -m pip install -q --disable-pip-version-check -e ".[${extra}dashboard]"
exec "$PY" -m dask_overlap demo "$@"
