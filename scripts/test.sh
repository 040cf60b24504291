#!/usr/bin/env bash
# Set everything up, then run the whole test suite (the README's second command; CI runs this).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
# tests/slurm runs jobs on a local single-node Slurm cluster: bring it up for the suite (as root; installs it with apt
# when missing) and take it down afterwards if this script started it. If it cannot come up, those tests are skipped
# with the reason.
if bash scripts/slurm_cluster.sh status >/dev/null 2>&1; then
  echo "[test] the local Slurm cluster is already up"
elif bash scripts/slurm_cluster.sh up; then
  trap 'bash scripts/slurm_cluster.sh down' EXIT
else
  echo "[test] warning: the local Slurm cluster did not come up; the Slurm integration tests will be skipped" >&2
fi
.venv/bin/python -m pytest -q -ra --durations=15 "$@"
