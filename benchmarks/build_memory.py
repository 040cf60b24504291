"""Peak memory of building the model and its optimizer per rank, under tensor and pipeline parallelism: the
trainer's build (megaloop.train.loop.build_model_and_optimizer: meta device, each rank materialises only the
parameters it holds, its tensor-parallel shards of its pipeline stage's) against building the whole model eagerly
on every rank first.

    python benchmarks/build_memory.py [--config configs/parcae-370m.yaml] [--tps 1,2] [--pps 1,2,4]
                                      [--set model.vocab_size=4096]

Every (tp, pp) pair runs in its own tp x pp processes (gloo, one thread each, MALLOC_MMAP_THRESHOLD_=65536 so that
freed tensors leave the resident set at once). Measured per rank, as the peak resident set (VmHWM, reset at the
start) minus the resident set at the start: "model", once the model is built, split and cut to the rank's stage (the
parameters this rank holds, plus the transient of building them), and "whole", after the gradient buffer and the
optimizer are built too; beside the bytes of the parameters the rank holds. tp 1 x pp 1 is one process (eager
build, nothing split, no gradient buffer). Three builds of every other layout:

- "meta + held", the trainer's build: one gradient buffer, the optimizer's chunked one (the runtime defers its plain
  buffer until gradients need it, see pipeline/runtime.py);
- "two buffers", the same build with the runtime's plain buffer laid out right after prepare_model, as it was before
  the deferral: the optimizer's buffer is then laid out while the plain one still holds a copy of every parameter;
- "eager", the whole model built on every rank, then split and cut (what each rank allocated before the meta build;
  under pp the parameters of the other stages stay allocated in the model).
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

VARIANTS = ("held", "two_buffers", "eager")


def measure(config: str, tp: int, pp: int, variant: str, sets: list[str]) -> dict:
    """One rank's figures for one build `variant` (see the module docstring) through the trainer's build."""
    import torch

    from megaloop.config import load_config
    from megaloop.model import build_model
    from megaloop.train.loop import build_model_and_optimizer
    from megaloop.train.runtime import make_runtime

    torch.set_num_threads(1)
    cfg = load_config(config, ["train.precision=fp32", f"parallel.tp={tp}", f"parallel.pp={pp}", "parallel.dp=1",
                               "data.micro_batch_size=1", f"data.global_batch_size={pp}", *sets])
    runtime = make_runtime(cfg, torch.device("cpu"))
    before = status_mb("VmRSS")
    reset_peak()
    peaks = {}
    prepare = runtime.prepare_model

    def prepare_model(model, materialize=None):
        def model_done(m, tp_info):
            if materialize is not None:
                materialize(m, tp_info)
            peaks["model"] = status_mb("VmHWM") - before

        if tp * pp == 1:  # the single-process runtime: an eager build, nothing to split
            model_done(model, None)
            return prepare(model)
        if variant == "eager":  # the whole model on every rank, split and cut afterwards
            model = build_model(cfg.model, seed=cfg.train.seed)
            materialize = None
        wrapped = prepare(model, materialize=model_done)
        if variant == "two_buffers":
            _ = runtime.buffer  # lays out the deferred plain buffer now, as prepare_model did before the deferral
        return wrapped

    runtime.prepare_model = prepare_model
    model, _ = build_model_and_optimizer(cfg, runtime, torch.device("cpu"))
    layout = getattr(runtime, "layout", None)
    result = {"rank": getattr(runtime, "rank", 0), "tp_rank": layout.tp_rank if layout else 0,
              "stage": layout.pp_rank if layout else 0, "model_mb": peaks["model"],
              "whole_mb": status_mb("VmHWM") - before,
              "held_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20}
    del model, _
    runtime.close()
    return result


def _child() -> None:
    config, tp, pp, variant, out = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], Path(sys.argv[6])
    result = measure(config, tp, pp, variant, json.loads(sys.argv[7]))
    Path(f"{out}.{result['rank']}").write_text(json.dumps(result))


def run(config: str, tp: int, pp: int, variant: str, sets: list[str]) -> list[dict]:
    """Every rank's figures (in rank order) of one build of the tp x pp layout in fresh processes."""
    world = tp * pp
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        launcher = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                        "--standalone", f"--nproc-per-node={world}"]
        cmd = launcher + [str(Path(__file__).resolve()), "--child", config, str(tp), str(pp), variant, str(out),
                          json.dumps(sets)]
        subprocess.run(cmd, check=True, cwd=REPO, env={**MEASURE_ENV, "PYTHONPATH": str(REPO)},
                       stdout=subprocess.DEVNULL)
        return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "parcae-370m.yaml"))
    parser.add_argument("--tps", type=process_counts, default="1,2",
                        help="tp sizes (each must divide the heads and the vocabulary)")
    parser.add_argument("--pps", type=process_counts, default="1",
                        help="pp sizes (each at most the core blocks); every (tp, pp) pair runs on tp x pp processes")
    parser.add_argument("--set", dest="sets", action="append", default=None,
                        help="config overrides; default model.vocab_size=4096, so that the parameters, not the "
                             "transient of the embedding's orthogonal init, set the peak")
    args = parser.parse_args()
    sets = ["model.vocab_size=4096"] if args.sets is None else args.sets
    print(f"build memory per rank, {Path(args.config).stem} {' '.join(sets)}, fp32, MiB: peak resident set above "
          "the start once the model is built and cut to the rank (model), and through the gradient buffer and "
          "optimizer (whole); x held = whole / held parameters")
    print(f"{'tp':>3} {'pp':>3} {'rank':>4} {'stage':>5} {'held params':>11} | {'model: meta + held':>18} "
          f"{'eager':>7} | {'whole: meta + held':>18} {'x held':>6} {'two buffers':>11} {'x held':>6} "
          f"{'eager':>7}")
    for pp in args.pps:
        for tp in args.tps:
            runs = {v: run(args.config, tp, pp, v, sets) for v in (VARIANTS if tp * pp > 1 else VARIANTS[:1])}
            for i, h in enumerate(runs["held"]):
                two, eager = runs.get("two_buffers", runs["held"])[i], runs.get("eager", runs["held"])[i]
                print(f"{tp:>3} {pp:>3} {h['rank']:>4} {h['stage']:>5} {h['held_mb']:>11.1f} | "
                      f"{h['model_mb']:>18.1f} {eager['model_mb']:>7.1f} | {h['whole_mb']:>18.1f} "
                      f"{h['whole_mb'] / h['held_mb']:>6.2f} {two['whole_mb']:>11.1f} "
                      f"{two['whole_mb'] / two['held_mb']:>6.2f} {eager['whole_mb']:>7.1f}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child()
    else:
        main()
