#!/usr/bin/env bash
# Set up megaloop on a fresh machine: a virtual environment in .venv with the pinned requirements, and Open MPI
# (for MPI-parallel data preparation) when it is missing and apt is available. Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if ! command -v mpirun >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "[setup] installing Open MPI (apt)"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libopenmpi-dev openmpi-bin >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PYTHON" -m venv .venv
fi
echo "[setup] installing pinned Python packages"
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . >/dev/null
echo "[setup] done: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
