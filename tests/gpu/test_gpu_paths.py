"""The GPU-only paths, checked on a CUDA machine by scripts/gpu_check.sh (skipped without a GPU): the trainer on
CUDA in bf16 (fused AdamW, autocast, depth sampling on the device) with a checkpoint written from GPU tensors through
pinned host buffers and read back bit for bit, every attention call of its first step run by the resolved kernel
(flash-attn when installed: counted, no fallback) and its CUDA memory peaks in the step records, the NCCL backend
of the runtime's reductions, and flash-attn against PyTorch's SDPA when flash-attn is installed."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]


def test_cuda_training_and_checkpoint_round_trip(corpus_shards, tmp_path):
    from checkpoints.load import CheckpointReader, find_checkpoints
    from megaloop.config import load_config
    from megaloop.train.loop import train
    from megaloop.train.runtime import SingleProcessRuntime

    class Keeping(SingleProcessRuntime):
        def prepare_model(self, model):
            self.model = model
            return model

    # eager (train.compile=false; auto compiles on a GPU): the first step's attention calls are counted one by one
    overrides = [f"data.shards={corpus_shards}", f"train.out_dir={tmp_path}", "train.steps=30", "train.device=cuda",
                 "train.precision=bf16", "train.progress=false", "data.val_batches=2", "checkpoint.every=10",
                 "train.compile=false"]
    runtime = Keeping(torch.device("cuda"))
    summary = train(load_config(str(REPO / "configs" / "parcae-tiny.yaml"), overrides), runtime=runtime)
    print(f"cuda parcae-tiny bf16: 30 steps, loss {summary.losses[0]:.4f} -> {summary.losses[-1]:.4f}, "
          f"{summary.tokens_per_s:,.0f} tokens/s, MFU {summary.useful_flops / summary.train_time_s / 1e12 / summary.peak_tflops:.2%} "
          f"of {summary.peak_tflops:.1f} TFLOP/s ({summary.peak_source})")
    assert summary.losses[-1] < summary.losses[0] - 0.5
    # the kernel model.attention=auto resolved (flash-attn when installed) ran every call of the first bf16 step
    print(f"attention in step 0: resolved {summary.attention}, ran {summary.attention_calls}, fallbacks "
          f"{summary.attention_fallbacks}")
    assert list(summary.attention_calls) == [summary.attention] and not summary.attention_fallbacks
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    peaks = [(r["gpu_max_allocated"], r["gpu_max_reserved"]) for r in records if r["kind"] == "train"]
    print(f"GPU memory: max allocated {summary.gpu_max_allocated / 2**20:.0f} MiB, reserved "
          f"{summary.gpu_max_reserved / 2**20:.0f} MiB (records: {peaks[0]} ... {peaks[-1]})")
    assert all(0 < a <= r for a, r in peaks) and peaks == sorted(peaks)  # running peaks: never decrease
    assert (summary.gpu_max_allocated, summary.gpu_max_reserved) == peaks[-1]
    reader = CheckpointReader(find_checkpoints(tmp_path / "checkpoints")[0])
    assert reader.step == 30
    for name, p in runtime.model.named_parameters():
        assert torch.equal(reader.read(f"model/{name}"), p.detach().cpu()), name


def test_nccl_reductions_of_the_runtime():
    import torch.distributed as dist

    from pipeline.layout import ParallelLayout
    from pipeline.runtime import ParallelRuntime

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        layout = ParallelLayout(rank=0, world_size=1, device=torch.device("cuda:0"), backend="nccl",
                                dp_group=dist.group.WORLD)
        runtime = ParallelRuntime(layout, tp_plan=[])
        assert runtime.world_max(3.0) == 3.0 and runtime.sum_over_dp(2.5) == 2.5
        t = torch.arange(4.0, device="cuda")
        dist.all_reduce(t)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["flash2", "flash3", "te"])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_attention_kernel_matches_sdpa(backend, kv_heads):
    """flash-attn 2, flash-attn 3 and TE's DotProductAttention against SDPA, forward and the gradients of q, k, v
    (bf16, causal, grouped kv heads); a kernel that is not installed skips, a broken one fails."""
    from megaloop.model.attention import AttentionBackendError, causal_attention, resolve_attention_backend

    try:
        resolve_attention_backend(backend, "cuda")
    except AttentionBackendError as err:
        if "not installed" in str(err):
            pytest.skip(str(err))
        raise
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 256, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 256, kv_heads, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    grads = {}
    for name in (backend, "sdpa"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = causal_attention(*leaves, backend=name)
        out.float().square().sum().backward()
        grads[name] = [out.detach().float()] + [t.grad.float() for t in leaves]
    errs = [(a - b).abs().max().item() for a, b in zip(grads[backend], grads["sdpa"])]
    print(f"{backend} vs SDPA (bf16, 2 x 256 x 8 heads ({kv_heads} kv) x 128): max abs diff out {errs[0]:.2e}, "
          f"dq {errs[1]:.2e}, dk {errs[2]:.2e}, dv {errs[3]:.2e}")
    assert errs[0] < 2e-2 and max(errs[1:]) < 0.25
