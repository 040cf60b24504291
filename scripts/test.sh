#!/usr/bin/env bash
# Set everything up, then run the whole test suite (the README's second command; CI runs this).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
.venv/bin/python -m pytest -q -ra --durations=15 "$@"
