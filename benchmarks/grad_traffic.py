"""Gradient traffic per rank per optimizer step of the native data-parallel engine, against DDP's fp32 all-reduce,
and (with --curves) the loss of bf16 vs fp32 gradient reduction over a short run.

    python benchmarks/grad_traffic.py [--dps 2,4] [--curves] [--steps 200] [--shards SHARD_DIR]

Traffic: parcae-tiny (fp32 parameters) runs one forward/backward per rank, then the step's reduction and optimizer
step (ZeRO-1: reduce-scatter, clip, Muon/AdamW on the owned chunk, all-gather) while every torch.distributed
collective is wrapped and counted with ring factors: all-reduce 2(n-1)/n, reduce-scatter, all-gather and
all-to-all (n-1)/n of the full tensor's bytes, broadcast the tensor's bytes, n the group's size. The reference is
DDP: one fp32 all-reduce of every gradient, 2(n-1)/n x 4 bytes x parameters.

Curves: the trainer (torchrun, gloo, dp 2) on parcae-tiny for --steps steps with parallel.grad_reduce_dtype=fp32
and =bf16 on the same shards and seed; the loss every 20th step side by side. Without --shards a tokenizer and
shards of the bundled sample corpus are built in a temporary folder.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "parcae-tiny.yaml"

# how many times the full tensor's bytes one rank sends, per collective, for a group of n ranks
RING_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "reduce_scatter_single": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "all_gather_single": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


def _full_bytes(name: str, args, kwargs) -> int:
    """Bytes of the full tensor a collective moves (the larger of output and input)."""
    tensors = list(args[:2]) + [kwargs.get(k) for k in ("output", "input", "tensor", "output_tensor_list",
                                                        "input_tensor_list", "output_tensor", "input_tensor")]
    return max(_nbytes(t) for t in tensors if t is not None)


class TrafficCounter:
    """Bytes sent per collective name (ring factors above) while the context is active."""

    def __init__(self):
        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def total(self) -> float:
        return sum(self.bytes.values())

    @contextlib.contextmanager
    def counting(self):
        originals = {name: getattr(dist, name) for name in RING_FACTORS if hasattr(dist, name)}

        def wrap(name, fn):
            def counted(*args, **kwargs):
                n = dist.get_world_size(kwargs.get("group"))
                if n > 1:
                    self.bytes[name] += RING_FACTORS[name](n) * _full_bytes(name, args, kwargs)
                    self.calls[name] += 1
                return fn(*args, **kwargs)
            return counted

        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


def measure_step(dp: int, wire: str, zero_stage: int = 1) -> dict:
    """On every rank of a dp-only world: one parcae-tiny step's gradient traffic (this rank's bytes) and DDP's."""
    from megaloop.config import load_config
    from megaloop.model import build_model
    from megaloop.optim import build_optimizer
    from megaloop.train.runtime import make_runtime

    cfg = load_config(str(CONFIG), ["train.precision=fp32", f"parallel.dp={dp}", "data.micro_batch_size=2",
                                    f"parallel.grad_reduce_dtype={wire}", f"parallel.zero_stage={zero_stage}"])
    runtime = make_runtime(cfg, torch.device("cpu"))
    try:
        model = runtime.prepare_model(build_model(cfg.model, seed=0))
        opt = build_optimizer(model.named_parameters(), cfg.optim, 10, parts=runtime.optimizer_parts())
        g = torch.Generator().manual_seed(runtime.dp_rank)
        ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1), generator=g)
        out = model(ids[:, :-1], labels=ids[:, 1:], depth=torch.tensor([3, 4]), backprop_depth=2,
                    noise_key=(0, 0, torch.arange(2) + 2 * runtime.dp_rank))
        out.loss.backward()
        before = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        counter = TrafficCounter()
        with counter.counting():
            runtime.reduce_gradients(model)
            record = opt.step(0)
            runtime.finish_param_gather()  # the step's all-gather (overlapped with a next forward that is not run)
        update = torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - before
        replicas = runtime.all_gather_object(hashlib.sha256(update.numpy().tobytes()).hexdigest())
        n = runtime.dp_size
        grads = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return {"dp": n, "wire": wire, "bytes": counter.total(), "by_op": dict(counter.bytes),
                "calls": dict(counter.calls), "ddp_bytes": 2 * (n - 1) / n * 4 * grads, "params": grads,
                "padded": runtime.buffer.numel(), "groups": len(runtime.buffer.groups),
                "grad_norm": record.grad_norm, "update": update,
                "replicas_identical": all(r == replicas[0] for r in replicas)}
    finally:
        runtime.reducer.remove_hooks()  # not close(): the next measurement reuses this torch.distributed world


def traffic_worker(rank: int, world: int, wires: list[str], out_path: str) -> None:
    results = [measure_step(world, wire) for wire in wires]
    if rank == 0:
        torch.save(results, out_path)


def traffic_table(dps: list[int]) -> list[dict]:
    from tests.pipeline.spawn import spawn

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dp in dps:
            out = Path(tmp) / f"dp{dp}.pt"
            spawn(traffic_worker, dp, ["fp32", "bf16"], str(out))
            rows += torch.load(out)
    return rows


def print_traffic(rows: list[dict]) -> None:
    print("gradient traffic per rank per step, parcae-tiny (fp32 parameters), ring factors; reference: DDP fp32 "
          "all-reduce of the gradients")
    print(f"{'dp':>3} {'reduction':>9} {'bytes/rank':>12} {'DDP bytes':>12} {'ratio':>8}  collectives (bytes)")
    for r in rows:
        ops = ", ".join(f"{k} x{r['calls'][k]} {v:,.0f}" for k, v in sorted(r["by_op"].items()))
        print(f"{r['dp']:>3} {r['wire']:>9} {r['bytes']:>12,.0f} {r['ddp_bytes']:>12,.0f} "
              f"{r['bytes'] / r['ddp_bytes']:>8.5f}  {ops}")
    print(f"(parameters {rows[0]['params']:,}; buffer elements with padding per dp: "
          + ", ".join(f"dp{r['dp']} {r['padded']:,}" for r in rows if r['wire'] == 'fp32') + ")")


def run_curve(shards: Path, wire: str, steps: int, out: Path) -> dict[int, float]:
    sets = [f"data.shards={shards}", f"train.steps={steps}", f"train.out_dir={out}", "train.progress=false",
            f"train.val_every={steps}", "train.val_depths=[4]", "parallel.dp=2", f"parallel.grad_reduce_dtype={wire}",
            "train.log_every=20"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "megaloop",
           "train", str(CONFIG), *[a for s in sets for a in ("--set", s)]]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    losses = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            losses[rec["step"]] = rec["loss"]
    return losses


def curves(shards: Path | None, steps: int) -> None:
    from benchmarks.parallel_layouts import build_shards

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shards = shards or build_shards(root)
        runs = {wire: run_curve(shards, wire, steps, root / wire) for wire in ("fp32", "bf16")}
    print(f"loss, parcae-tiny dp2, gradient reduction fp32 vs bf16 ({steps} steps, every 20th)")
    print(f"{'step':>5} {'fp32':>9} {'bf16':>9} {'bf16-fp32':>10}")
    for step in sorted(set(runs["fp32"]) & set(runs["bf16"])):
        if step % 20 == 0 or step == steps - 1:
            a, b = runs["fp32"][step], runs["bf16"][step]
            print(f"{step:>5} {a:>9.4f} {b:>9.4f} {b - a:>+10.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dps", default="2,4", help="data-parallel sizes for the traffic table")
    parser.add_argument("--curves", action="store_true", help="also train fp32 vs bf16 reduction (dp 2)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--shards", type=Path, default=None)
    args = parser.parse_args()
    print_traffic(traffic_table([int(x) for x in args.dps.split(",")]))
    if args.curves:
        curves(args.shards, args.steps)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
