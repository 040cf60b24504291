"""Resident memory per rank of the native ZeRO-1 optimizer step at dp 1, 2 and 4, and the step's transient.

    python benchmarks/zero_memory.py [--dps 1,2,4] [--d-model 512] [--vocab 8192]

dp 1 is one process with the plain optimizer (the single-process runtime), for comparison. Each dp size runs in its
own processes (gloo, one thread each, MALLOC_MMAP_THRESHOLD_=65536 so that a freed tensor
above 64 KiB leaves the resident set at once and the figures follow live tensors). A Parcae model (parcae-tiny's
shape widened by --d-model and --vocab, fp32) gets synthetic gradients in its gradient buffer, takes two steps (the
first creates the optimizer state), then the third step is measured: peak resident set (RSS, the kernel's VmHWM,
reset just before the step) minus the resident set before it. That transient is what the step allocates on top of
parameters, gradients and optimizer state: the gradient reduction (bucket copies), clipping, Muon's per-matrix work
(a full gradient and update of one matrix at a time) and the all-gather, which writes in place; no flattened copy of
the parameters or gradients is made. Printed per rank: resident before the step, the transient, the optimizer state
bytes, and the model's parameter bytes for scale.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.rss import MEASURE_ENV, process_counts, reset_peak, status_mb  # noqa: E402


def _state_bytes(optimizer) -> int:
    if hasattr(optimizer, "state_bytes"):
        return optimizer.state_bytes()
    return sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values()
               if hasattr(t, "element_size"))


def measure(rank: int, world: int, d_model: int, vocab: int) -> dict:
    import torch

    from megaloop.config import load_config
    from megaloop.model import build_model
    from megaloop.optim import build_optimizer
    from megaloop.train.runtime import make_runtime

    torch.set_num_threads(1)
    cfg = load_config(str(REPO / "configs" / "parcae-tiny.yaml"),
                      ["train.precision=fp32", f"parallel.dp={world}", "data.micro_batch_size=1",
                       f"model.d_model={d_model}", f"model.vocab_size={vocab}", "data.global_batch_size=16"])
    runtime = make_runtime(cfg, torch.device("cpu"))  # one process: the single-process runtime, plain optimizer
    model = runtime.prepare_model(build_model(cfg.model, seed=0))
    parts = runtime.optimizer_parts() if hasattr(runtime, "optimizer_parts") else None
    opt = build_optimizer(model.named_parameters(), cfg.optim, 10, parts=parts)
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g) if p.grad is None else p.grad.copy_(torch.randn(p.shape))
        if step == 2:
            before = status_mb("VmRSS")
            reset_peak()
        runtime.reduce_gradients(model)
        opt.step(step)
        if hasattr(runtime, "finish_param_gather"):
            runtime.finish_param_gather()  # the step's all-gather, else left to a next forward not run here
        opt.zero_grad()
    peak = status_mb("VmHWM")
    state = sum(_state_bytes(o) for o in (opt.muon, opt.adamw))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"rank": rank, "dp": world, "before_mb": before, "transient_mb": peak - before,
            "state_mb": state / 2**20, "param_mb": params / 2**20}


def _child() -> None:
    import json

    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    result = measure(rank, world, int(sys.argv[2]), int(sys.argv[3]))
    out = [result]
    if dist.is_initialized():
        out = [None] * world
        dist.all_gather_object(out, result)
    if rank == 0:
        Path(sys.argv[4]).write_text(json.dumps(out))
    from pipeline.layout import destroy_layout

    destroy_layout()


def run(dp: int, d_model: int, vocab: int) -> list[dict]:
    import json

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={dp}",
               str(Path(__file__).resolve()), "--child", str(d_model), str(vocab), str(out)]
        subprocess.run(cmd, check=True, cwd=REPO, env={**MEASURE_ENV, "PYTHONPATH": str(REPO)},
                       stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dps", type=process_counts, default="1,2,4", help="data-parallel sizes")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    print("ZeRO-1 step memory per rank (resident set, MiB; transient = peak during the step - resident before it)")
    print(f"{'dp':>3} {'rank':>4} {'resident':>9} {'transient':>9} {'opt state':>9} {'params':>8}")
    for dp in args.dps:
        for r in run(dp, args.d_model, args.vocab):
            print(f"{r['dp']:>3} {r['rank']:>4} {r['before_mb']:>9.1f} {r['transient_mb']:>9.1f} "
                  f"{r['state_mb']:>9.1f} {r['param_mb']:>8.1f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child()
    else:
        main()
