#!/usr/bin/env bash
# The README's first command: set everything up and run the main job on the embedded default — train a BPE
# tokenizer on the bundled sample corpus, write tokenized webdataset shards, train parcae-tiny for a few minutes on
# NPROC CPU processes (data parallel, default 2) and print the summary table.
# Outputs land in runs/quickstart/ (override with OUT=...).
# Extra arguments are passed to `megaloop train` as config overrides, e.g. `train.steps=50`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
OUT=${OUT:-runs/quickstart}
CORPUS=${CORPUS:-data/sample_corpus}
mkdir -p "$OUT"
if [ ! -f "$OUT/tokenizer/tokenizer.json" ]; then
  $PY -m data_prep tokenizer --input "$CORPUS" --output "$OUT/tokenizer" --vocab-size 4096
fi
if [ ! -f "$OUT/shards/manifest.json" ]; then
  $PY -m data_prep shards --input "$CORPUS" --tokenizer "$OUT/tokenizer" --output "$OUT/shards" --seq-len 128
fi
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
overrides=(--set "data.shards=$OUT/shards" --set "train.out_dir=$OUT/train" --set "parallel.dp=$NPROC")
for o in "$@"; do overrides+=(--set "$o"); done
# several CPU processes: data parallel over NPROC ranks (gloo), one torchrun job
.venv/bin/torchrun --standalone --nproc-per-node "$NPROC" -m megaloop train configs/parcae-tiny.yaml "${overrides[@]}"
