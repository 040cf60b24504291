"""DeepSpeed on NCCL (checked by scripts/gpu_check.sh; skipped without a GPU): megaloop's trainer on parcae-tiny in
fp32 on CUDA with DeepSpeed ZeRO-2 as the engine, in a one-rank NCCL world (one GPU: NCCL refuses two ranks on one
device), against the single-process trainer on the same GPU. The dp = 2 equivalence of every ZeRO stage is proven on
CPU with gloo (tests/pipeline/test_deepspeed.py); what only a GPU shows is DeepSpeed's CUDA path: its NCCL
communicator, its flat fp32 buffers on the device, torch AdamW on those, and the gradient boundary."""
from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from tests.gpu.gpu_data import novel_shards

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
STEPS = 6
TOL = 1e-5  # relative, per step's loss: fp32 on one GPU, DeepSpeed's flat buffers against per-tensor AdamW


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Vocab 512, rows of 65 tokens: a small fp32 model."""
    return novel_shards(tmp_path_factory.mktemp("gpu_ds_data"), 512, 64)


def test_deepspeed_zero2_on_nccl_equals_single_process(shards, tmp_path):
    pytest.importorskip("deepspeed")
    import torch.distributed as dist

    from megaloop.config import load_config
    from megaloop.train.loop import train
    from megaloop.train.runtime import SingleProcessRuntime
    from pipeline.deepspeed_engine import DeepSpeedRuntime
    from pipeline.layout import ParallelLayout

    def cfg(out: str, *extra: str):
        return load_config(str(REPO / "configs" / "parcae-tiny.yaml"), [
            f"data.shards={shards}", f"train.out_dir={tmp_path / out}", f"train.steps={STEPS}", "model.vocab_size=512",
            "model.seq_len=64", "data.micro_batch_size=2", "data.global_batch_size=8", "data.val_batches=1",
            "train.val_every=1000", "train.progress=false", "train.precision=fp32", "train.device=cuda",
            "train.compile=false", "optim.name=adamw", "optim.adam_weight_decay=0.1", "optim.eps=1e-6", *extra])

    native = train(cfg("native"), runtime=SingleProcessRuntime(torch.device("cuda")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        layout = ParallelLayout(rank=0, world_size=1, device=torch.device("cuda:0"), backend="nccl",
                                dp_group=dist.group.WORLD)
        runtime = DeepSpeedRuntime(layout, zero_stage=2, micro_batch=2, micro_batches_per_step=4)
        zero2 = train(cfg("zero2", "parallel.engine=deepspeed", "parallel.zero_stage=2"), runtime=runtime)
        engine = type(runtime.proxy.engine.optimizer).__name__
        on_gpu = next(runtime.model.parameters()).device.type
    finally:
        dist.destroy_process_group()
    err = max(abs(a - b) / abs(b) for a, b in zip(zero2.losses, native.losses))
    print(f"DeepSpeed ZeRO-2 on NCCL ({engine}, parameters on {on_gpu}) vs single-process trainer, parcae-tiny fp32, "
          f"{STEPS} steps: losses {' '.join(f'{x:.5f}' for x in zero2.losses)}; worst rel err {err:.1e}")
    assert len(zero2.losses) == STEPS and on_gpu == "cuda"
    assert err < TOL
    assert zero2.losses[-1] < zero2.losses[0]
