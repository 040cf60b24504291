"""Peak memory of building the model per tensor-parallel rank: the trainer's build (meta device, each rank
materialises only its shards) against building the whole model eagerly and then splitting it.

    python benchmarks/build_memory.py [--config configs/parcae-370m.yaml] [--tps 1,2] [--set model.vocab_size=4096]

Each tp size runs in its own processes (gloo, one thread each, MALLOC_MMAP_THRESHOLD_=65536 so that freed tensors
leave the resident set at once). Measured per rank, as the peak resident set (VmHWM, reset at the start) minus the
resident set at the start: "model", once the model is built and split (the parameters this rank holds, plus the
transient of building them), and "whole", after the gradient buffer and the optimizer are built too; beside the
bytes of the parameters the rank holds. tp 1 is one process (eager build, nothing split). "eager + split" builds
the whole model on every rank and splits it afterwards (the trainer's build before), for comparison.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.rss import MEASURE_ENV, process_counts, reset_peak, status_mb  # noqa: E402


def measure(config: str, tp: int, eager: bool, sets: list[str]) -> dict:
    import torch

    from megaloop.config import load_config
    from megaloop.model import build_model
    from megaloop.optim import build_optimizer
    from megaloop.train.build import held_parameters
    from megaloop.train.runtime import make_runtime

    torch.set_num_threads(1)
    cfg = load_config(config, ["train.precision=fp32", f"parallel.tp={tp}", "parallel.dp=1", "data.micro_batch_size=1",
                               "data.global_batch_size=1", *sets])
    runtime = make_runtime(cfg, torch.device("cpu"))
    before = status_mb("VmRSS")
    reset_peak()
    peaks = {}

    def model_done(model, tp_info, fill=None):
        if fill is not None:
            fill(model, tp_info)
        peaks["model"] = status_mb("VmHWM") - before

    if tp == 1:
        model = build_model(cfg.model, seed=cfg.train.seed)
        model_done(model, None)
        model = runtime.prepare_model(model)
    elif eager:  # the whole model on every rank, split afterwards (the trainer's build before)
        model = runtime.prepare_model(build_model(cfg.model, seed=cfg.train.seed), materialize=model_done)
    else:  # the trainer's build: meta, then this rank's shards only
        fill = held_parameters(cfg.model, cfg.train.seed, torch.device("cpu"))
        model = runtime.prepare_model(build_model(cfg.model, device="meta"),
                                      materialize=lambda m, info: model_done(m, info, fill))
    parts = runtime.optimizer_parts() if tp > 1 else None
    build_optimizer(model.named_parameters(), cfg.optim, cfg.train.steps, parts=parts)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    result = {"tp": tp, "rank": getattr(runtime, "rank", 0), "model_mb": peaks["model"],
              "peak_mb": status_mb("VmHWM") - before, "held_mb": held / 2**20}
    runtime.close()
    return result


def _child() -> None:
    config, tp, eager, out = sys.argv[2], int(sys.argv[3]), sys.argv[4] == "eager", Path(sys.argv[5])
    result = measure(config, tp, eager, json.loads(sys.argv[6]))
    Path(f"{out}.{result['rank']}").write_text(json.dumps(result))


def run(config: str, tp: int, eager: bool, sets: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        launcher = [sys.executable] if tp == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc-per-node={tp}"]
        cmd = launcher + [str(Path(__file__).resolve()), "--child", config, str(tp),
                          "eager" if eager else "held", str(out), json.dumps(sets)]
        subprocess.run(cmd, check=True, cwd=REPO, env={**MEASURE_ENV, "PYTHONPATH": str(REPO)},
                       stdout=subprocess.DEVNULL)
        return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(tp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "parcae-370m.yaml"))
    parser.add_argument("--tps", type=process_counts, default="1,2", help="tp sizes (each must divide the heads and the vocabulary)")
    parser.add_argument("--set", dest="sets", action="append", default=None,
                        help="config overrides; default model.vocab_size=4096, so that the parameters, not the "
                             "transient of the embedding's orthogonal init, set the peak")
    args = parser.parse_args()
    sets = ["model.vocab_size=4096"] if args.sets is None else args.sets
    print(f"build memory per rank, {Path(args.config).stem} {' '.join(sets)}, fp32, MiB: peak resident set above the start while the "
          "model is built and split (model), and through the gradient buffers and optimizer (whole)")
    print(f"{'tp':>3} {'rank':>4} {'held params':>11} {'model: meta + held':>18} {'eager + split':>13} "
          f"{'whole: meta + held':>18} {'eager + split':>13}")
    for tp in args.tps:
        held = run(args.config, tp, eager=False, sets=sets)
        eager = run(args.config, tp, eager=True, sets=sets) if tp > 1 else held
        for h, e in zip(held, eager):
            print(f"{tp:>3} {h['rank']:>4} {h['held_mb']:>11.1f} {h['model_mb']:>18.1f} {e['model_mb']:>13.1f} "
                  f"{h['peak_mb']:>18.1f} {e['peak_mb']:>13.1f}")

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child()
    else:
        main()
