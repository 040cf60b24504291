#!/usr/bin/env bash
# Throughput on one GPU (called by scripts/gpu_check.sh): parcae-770m at seq 2048 through `megaloop bench`, printing
# tokens/s, useful/executed TFLOP/s and MFU against the bf16 and FP8 dense peaks, for
#   bf16, torchao-recipe FP8 (train.fp8=tensorwise) and Transformer Engine FP8 (Float8CurrentScaling; when
#   transformer_engine.pytorch imports), each eager and with train.compile=true, model.attention=auto
#   (flash-attn 3, else 2, else SDPA);
#   then bf16 eager with model.attention=sdpa, beside auto.
# Shards: SHARDS=DIR, else made once from data/sample_corpus under runs/gpu_check. STEPS (default 5) measured after
# WARMUP (default 2); BENCH_SETS: extra overrides for every run, e.g. BENCH_SETS="data.micro_batch_size=4".
# Time on one H200 (989 TFLOP/s bf16 dense): 6.85 GFLOP/token (`megaloop flops configs/parcae-770m.yaml`) x 32768
# tokens/step = 224 TFLOP/step, ~0.6 s/step at 35% MFU (less in FP8), so ~5 s of steps per run; with start-up
# (~20 s) and compilation (~60 s) the 7 runs take ~5-6 minutes. A failing run is reported and the others go on;
# the exit status is that of the last failure (0 when all ran).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  PY=python3
  [ -x .venv/bin/python ] && PY=.venv/bin/python
fi
OUT=runs/gpu_check
SHARDS=${SHARDS:-$OUT/shards2048}
if [ ! -f "$SHARDS/manifest.json" ]; then
  mkdir -p "$OUT"
  "$PY" -m data_prep tokenizer --input data/sample_corpus --output "$OUT/tokenizer" --vocab-size 4096 --overwrite &&
  "$PY" -m data_prep shards --input data/sample_corpus --tokenizer "$OUT/tokenizer" --output "$SHARDS" \
    --seq-len 2048 --packing stream --overwrite ||
    { echo "gpu_bench: could not build the shards in $SHARDS" >&2; exit 1; }
fi
sets=(--set "data.shards=$SHARDS" --set train.device=cuda --set train.precision=bf16 --set train.progress=false
      --set data.global_batch_size=16 --set data.micro_batch_size=8)
for s in ${BENCH_SETS:-}; do sets+=(--set "$s"); done
variants=("bf16|" "torchao-fp8|train.fp8=tensorwise")
if "$PY" -c "import transformer_engine.pytorch" >/dev/null 2>&1; then
  variants+=("te-fp8|train.fp8=tensorwise train.fp8_backend=te")
else
  echo "== TE FP8: skipped (transformer_engine.pytorch does not import here)"
fi
status=0
bench() {  # name, then --set values
  local name=$1
  shift
  local extra=()
  for s in "$@"; do extra+=(--set "$s"); done
  echo "== bench parcae-770m, seq 2048, $name ($*)"
  rm -rf "${OUT:?}/bench_$name"
  "$PY" -m megaloop bench configs/parcae-770m.yaml --steps "${STEPS:-5}" --warmup "${WARMUP:-2}" \
    --out-dir "$OUT/bench_$name" --png "$OUT/bench_$name.png" "${sets[@]}" "${extra[@]}" ||
    { status=$?; echo "== bench $name failed (exit $status)"; }
}
for compile in false true; do
  for variant in "${variants[@]}"; do
    read -r -a fp8 <<< "${variant#*|}"
    bench "${variant%%|*}-compile-$compile" ${fp8[@]+"${fp8[@]}"} "train.compile=$compile" model.attention=auto
  done
done
bench bf16-sdpa train.compile=false model.attention=sdpa
exit $status
