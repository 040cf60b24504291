#!/usr/bin/env bash
# Every GPU-only check of megaloop in one run (meant for under 10 minutes on one GPU), printing its figures: a whole
# training step compiled with flash-attn under CUDA's sync debug mode (no host sync in the micro-batch loops, at most
# one in the step: tests/gpu/test_gpu_step_sync.py), the trainer on CUDA in bf16 with a checkpoint written from GPU
# tensors through pinned host buffers and read back bit for bit, the runtime's reductions on NCCL, and flash-attn
# against PyTorch's SDPA (when flash-attn is installed: requirements-gpu.txt), and FP8 (tests/gpu/test_gpu_fp8.py):
# the torchao-recipe layers against fp32 on parcae-140m at T = 1, 4, 8, the T-lap FP8 core against unrolled copies,
# and Transformer Engine's blocks against the native ones (T = 1 and 4), its key mapping, its unrolled-copy gradient
# and recompute (skipped, with the reason printed, where TE is not installed). Nothing is installed here: it uses
# $PYTHON when set, else .venv when present, else python3, which must already have the packages of requirements.txt
# (with torch's CUDA build). Then the attention kernels (flash-attn 2 and 3, TE) against SDPA; FP8 against bf16 in
# training: parcae-140m (seq 512, 16 rows per step), 50 steps each of bf16, torchao-recipe FP8 tensorwise and
# rowwise, and TE FP8 (current scaling) where TE imports, the loss curves printed side by side and every final
# training/validation loss bound to within 1.5% of bf16's (benchmarks/fp8_curves.py; the CPU's parcae-tiny runs
# stay within 0.06% over 300 steps); and the throughput of parcae-770m at seq 2048 in bf16, torchao FP8 and TE FP8,
# eager and compiled (scripts/gpu_bench.sh: `megaloop bench`, tokens/s and MFU); its shards are made once from
# data/sample_corpus under runs/gpu_check (or SHARDS=DIR: shards of seq_len 2048 and vocab <= 32768).
# Time on one H200, estimated from the FLOPs: the pytest checks ~2 min; the FP8 loss runs 4 x 50 steps x 8192
# tokens x ~0.9 GFLOP/token = 1.5 PFLOP, seconds of GEMMs, ~2 min with start-up and validation; the throughput runs
# ~5-6 min (scripts/gpu_bench.sh): under 10 minutes in all. DeepSpeed on NCCL: tests/gpu/test_gpu_deepspeed.py.
# Time limits, for a machine lent for a few minutes: LIMIT_TESTS, LIMIT_FP8 and LIMIT_BENCH (seconds; unset: none)
# bound the three parts; a part that runs out is reported as failed (exit 124) and the next one starts.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  PY=python3
  [ -x .venv/bin/python ] && PY=.venv/bin/python
fi
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_check: no nvidia-smi here; run this on a machine with a CUDA GPU" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" - <<'PYEOF'
import importlib, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {torch.cuda.get_device_name(0)}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
for name in ("flash_attn", "flash_attn_interface", "transformer_engine.pytorch", "deepspeed"):
    try:
        mod = importlib.import_module(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
    except Exception as err:  # report, do not fail: the tests skip what is missing
        print(f"{name}: not available ({type(err).__name__})")
major, minor = torch.cuda.get_device_capability(0)
print(f"FP8 GEMMs (torch._scaled_mm): {'yes' if (major, minor) >= (8, 9) else 'no'} (sm{major}{minor}; sm89+ needed)")
PYEOF
export PYTHONUNBUFFERED=1
status=0
limit() {  # seconds (empty: no limit), then the command
  local seconds=$1
  shift
  timeout "${seconds:-0}" "$@"
}
limit "${LIMIT_TESTS:-}" "$PY" -m pytest -q -s -rs -p no:cacheprovider -m gpu tests/gpu "$@" || status=$?
# document masking (model.doc_mask): flash-attn 2/3's varlen function and TE's "thd" / padding_causal attention
# against sdpa's block-causal mask and each document alone, bf16, mixed depths (seconds; LIMIT_DOC_MASK bounds it)
echo "== document masking: varlen kernels vs sdpa's mask (tests/model/test_doc_mask_gpu.py)"
limit "${LIMIT_DOC_MASK:-}" "$PY" -m pytest -q -s -rs -p no:cacheprovider -m gpu tests/model/test_doc_mask_gpu.py \
  || status=$?
fp8_runs=(none tensorwise rowwise)
if "$PY" -c "import transformer_engine.pytorch" >/dev/null 2>&1; then
  fp8_runs+=(te)
else
  echo "== FP8 loss, TE run: skipped (transformer_engine.pytorch does not import here)"
fi
echo "== FP8 vs bf16: parcae-140m, 50 steps, seq 512 (${fp8_runs[*]})"
mkdir -p runs/gpu_check
limit "${LIMIT_FP8:-}" "$PY" benchmarks/fp8_curves.py --config configs/parcae-140m.yaml --steps 50 --seq-len 512 --window 10 --tail 10 \
  --runs "${fp8_runs[@]}" --corpus data/sample_corpus --png runs/gpu_check/fp8_loss_140m.png \
  --set train.device=cuda --set train.compile=false --set train.progress=false --set data.global_batch_size=16 \
  --set data.micro_batch_size=16 \
  || status=$?
limit "${LIMIT_BENCH:-}" env PYTHON="$PY" bash scripts/gpu_bench.sh || status=$?
exit $status
