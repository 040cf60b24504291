#!/usr/bin/env bash
# Throughput on one GPU (called by scripts/gpu_check.sh): parcae-770m at seq 2048 in bf16 through `megaloop bench`,
# once per attention kernel that is installed (auto: flash-attn 3, else 2, else SDPA; and SDPA itself), printing
# tokens/s, useful/executed TFLOP/s and MFU against the bf16 and FP8 dense peaks. Shards: SHARDS=DIR, else made once
# from data/sample_corpus under runs/gpu_check. STEPS (default 10) measured after WARMUP (default 3);
# BENCH_SETS: extra overrides, e.g. BENCH_SETS="train.compile=true".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
OUT=runs/gpu_check
SHARDS=${SHARDS:-$OUT/shards2048}
if [ ! -f "$SHARDS/manifest.json" ]; then
  mkdir -p "$OUT"
  "$PY" -m data_prep tokenizer --input data/sample_corpus --output "$OUT/tokenizer" --vocab-size 4096 --overwrite
  "$PY" -m data_prep shards --input data/sample_corpus --tokenizer "$OUT/tokenizer" --output "$SHARDS" \
    --seq-len 2048 --overwrite
fi
sets=(--set "data.shards=$SHARDS" --set train.device=cuda --set train.precision=bf16 --set train.progress=false
      --set data.global_batch_size=16 --set data.micro_batch_size=8)
for s in ${BENCH_SETS:-}; do sets+=(--set "$s"); done
for attention in auto sdpa; do
  echo "== bench parcae-770m, seq 2048, bf16, model.attention=$attention"
  rm -rf "$OUT/bench_$attention"
  "$PY" -m megaloop bench configs/parcae-770m.yaml --steps "${STEPS:-10}" --warmup "${WARMUP:-3}" \
    --out-dir "$OUT/bench_$attention" --png "$OUT/bench_$attention.png" "${sets[@]}" --set "model.attention=$attention"
done
