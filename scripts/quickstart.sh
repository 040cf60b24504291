#!/usr/bin/env bash
# The README's first command: set everything up and run the main job on the embedded default — train a BPE
# tokenizer on the bundled sample corpus, write tokenized webdataset shards, train parcae-tiny for a few minutes on
# NPROC CPU processes (data parallel, default 2) and print the summary table.
# Outputs land in runs/quickstart/ (override with OUT=...); CORPUS=DIR trains on another directory of text files
# (shards already in OUT are reused only when they were made from CORPUS: another corpus needs another OUT).
# Extra arguments are passed to `megaloop train` as config overrides, e.g. `train.steps=50`.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  echo "usage: [OUT=DIR] [CORPUS=DIR] [NPROC=N] bash scripts/quickstart.sh [section.key=value ...]"
  echo "  e.g. bash scripts/quickstart.sh train.steps=50 (each argument is a megaloop config override)"
}
fail() {  # one line, exit status 2: bad input
  echo "quickstart: $*" >&2
  exit 2
}
for o in "$@"; do
  case "$o" in
    -h|--help) usage; exit 0 ;;
    -*) fail "unknown option $o; arguments are config overrides section.key=value (see --help)" ;;
    *=*) ;;
    *) fail "argument '$o' is not a config override; write section.key=value, e.g. train.steps=50" ;;
  esac
done
NPROC=${NPROC:-2}
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || fail "NPROC=$NPROC is not a positive integer; set e.g. NPROC=2"
OUT=${OUT:-runs/quickstart}
CORPUS=${CORPUS:-data/sample_corpus}
[ -d "$CORPUS" ] || fail "CORPUS=$CORPUS is not a directory; point it at a directory of text files"

bash scripts/setup.sh
PY=.venv/bin/python
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
overrides=(--set "data.shards=$OUT/shards" --set "train.out_dir=$OUT/train" --set "parallel.dp=$NPROC")
for o in "$@"; do overrides+=(--set "$o"); done
# the overrides are checked (for a job of NPROC processes) before any data is prepared: a typo costs seconds
checks=("${overrides[@]:2}")
WORLD_SIZE=$NPROC $PY -m megaloop check configs/parcae-tiny.yaml "${checks[@]}" >/dev/null || exit 2

mkdir -p "$OUT"
if [ -f "$OUT/shards/manifest.json" ]; then
  # existing shards are reused only when they were made from CORPUS (same files, same sizes)
  compare='import sys; from data_prep.manifest import corpus_mismatch; print(corpus_mismatch(*sys.argv[1:]) or "")'
  problem=$($PY -c "$compare" "$OUT/shards" "$CORPUS")
  [ -z "$problem" ] || fail "the shards in $OUT/shards do not fit CORPUS=$CORPUS: $problem; pass OUT=another" \
    "directory to build from this corpus (or remove $OUT)"
else
  $PY -m data_prep tokenizer --input "$CORPUS" --output "$OUT/tokenizer" --vocab-size 4096 --overwrite
  # stream packing: the sample corpus is nine novels, one document each, so best fit (the default: every row starts
  # at a document's BOS, and what does not fit a row is dropped) would keep one 129-token row per novel. The
  # summary it prints says what packing cost: tokens dropped, pad tokens, documents cut.
  $PY -m data_prep shards --input "$CORPUS" --tokenizer "$OUT/tokenizer" --output "$OUT/shards" --seq-len 128 \
    --packing stream --overwrite
fi
# several CPU processes: data parallel over NPROC ranks (gloo), one torchrun job
.venv/bin/torchrun --standalone --nproc-per-node "$NPROC" -m megaloop train configs/parcae-tiny.yaml "${overrides[@]}"
