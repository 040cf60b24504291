#!/usr/bin/env bash
# Set up megaloop on a fresh machine: a virtual environment in .venv with the pinned requirements, wandb and DeepSpeed
# (whose CPU comm op is compiled once into .venv/torch_extensions), Open MPI (for MPI-parallel data preparation) and
# g++ (for that op) when missing and apt is available. Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if ! command -v mpirun >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  # g++ (for DeepSpeed's op, below) in the same apt run when it is missing too: one package-list update, not two
  APT_PACKAGES=(libopenmpi-dev openmpi-bin)
  command -v "${CXX:-c++}" >/dev/null 2>&1 || APT_PACKAGES+=(g++)
  echo "[setup] installing ${APT_PACKAGES[*]} (apt)"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${APT_PACKAGES[@]}" >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PYTHON" -m venv .venv
fi
# A set-up .venv records what it was set up from; the same inputs again skip the installs and the DeepSpeed op check
# (a minute on 2 cores: the quickstart and the tests call this script). SETUP_FORCE=1 redoes everything.
STAMP=.venv/.megaloop-setup
INPUTS=$(cat requirements*.txt pyproject.toml scripts/setup.sh pipeline/deepspeed_engine.py | sha256sum | cut -d' ' -f1)
if [ "${SETUP_FORCE:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(sed -n 1p "$STAMP")" = "$INPUTS" ] \
    && [ -e "$(sed -n 2p "$STAMP")" ]; then
  echo "[setup] up to date (requirements and DeepSpeed op unchanged since the last setup; SETUP_FORCE=1 redoes it)"
  exit 0
fi
rm -f "$STAMP"
echo "[setup] installing pinned Python packages (with DeepSpeed and wandb)"
# one resolution for everything, so that DeepSpeed's torch>=2.0 is met by torch's own pin; no compiled ops at install.
# wandb (train.wandb) in the same resolution: requirements-wandb.txt holds requirements.txt, so torch stays pinned
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt \
  -r requirements-deepspeed.txt -r requirements-wandb.txt
echo "[setup] installing the lm-eval harness (requirements-eval.txt, runtime pins as constraints)"
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-eval.txt -c requirements.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . >/dev/null
TORCH_PIN=$(sed -n 's/^torch==//p' requirements.txt)
TORCH_HAVE=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
if [ "$TORCH_HAVE" != "$TORCH_PIN" ]; then
  echo "[setup] error: torch $TORCH_HAVE is installed but requirements.txt pins $TORCH_PIN; remove .venv and re-run" >&2
  exit 1
fi

# DeepSpeed's CPU communication loads a small shared-memory op that torch compiles with g++ and ninja on first use;
# build it here once (one to two minutes on 2 cores, a few seconds when already built), not in every training process.
CXX_BIN=${CXX:-c++}
if ! command -v "$CXX_BIN" >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "[setup] installing g++ (apt), needed to build DeepSpeed's CPU comm op"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ >/dev/null
fi
if ! command -v "$CXX_BIN" >/dev/null 2>&1; then
  echo "[setup] error: no C++ compiler ($CXX_BIN) found; DeepSpeed's CPU comm op needs one: install g++" \
       "(e.g. apt-get install g++) or set CXX, then re-run" >&2
  exit 1
fi
DS_START=$SECONDS
DS_LOG=$(mktemp)
if ! PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -c \
    'from pipeline.deepspeed_engine import build_comm_op; print("DS_OP", build_comm_op())' >"$DS_LOG" 2>&1; then
  cat "$DS_LOG" >&2
  rm -f "$DS_LOG"
  echo "[setup] error: building DeepSpeed's CPU comm op failed (output above)" >&2
  exit 1
fi
DS_VERSION=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("deepspeed"))')
DS_OP=$(sed -n 's/^DS_OP //p' "$DS_LOG")
echo "[setup] DeepSpeed $DS_VERSION comm op $DS_OP ($((SECONDS - DS_START)) s)"
rm -f "$DS_LOG"
DS_DIR=$(printf '%s\n' "$DS_OP" | grep -o '/[^ ]*' | head -n 1 || true)
printf '%s\n%s\n' "$INPUTS" "${DS_DIR:-$STAMP}" > "$STAMP"
echo "[setup] done: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
