"""The trainer's build (megaloop.train.loop.build_model_and_optimizer with make_runtime's runtime) under every pipeline
layout, on 1 and 2 torch threads per process, against a single-process eager build with the same seed (1 thread).

    python benchmarks/build_layouts.py [--threads 1,2] [--precisions fp64,fp32]

Layouts: pp2 (2 processes), pp4, pp2 x tp2, pp2 x dp2 (4), pp2 x tp2 x dp2 (8); parcae-tiny with 4 core blocks and
vocabulary 512 (the layout test's model, tests/pipeline/test_stage_build.py, which runs the 4-process layouts on one
thread). Per layout it prints how many ranks hold exactly their stage's parameters (stage_parameter_names) with
nothing else allocated, how many held parameters, gathered over tp, are bit-identical (torch.equal) to the eager
build, and whether the stages together hold every parameter (the tied embedding on the first and last stage only).
Exits 1 if any check fails.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.rss import process_counts  # noqa: E402

# label: (pp, tp, world); dp = world / (pp x tp)
LAYOUTS = {"pp2": (2, 1, 2), "pp4": (4, 1, 4), "pp2xtp2": (2, 2, 4), "pp2xdp2": (2, 1, 4), "pp2xtp2xdp2": (2, 2, 8)}


def run_world(world: int, runs: dict, threads: int) -> dict:
    """{label: every rank's build report, in rank order} for the runs of one world size."""
    import torch

    from tests.pipeline.spawn import spawn
    from tests.pipeline.test_stage_build import TINY
    from tests.pipeline.workers_build import build_worker

    with tempfile.TemporaryDirectory() as tmp:
        spawn(build_worker, world, str(TINY), runs, str(Path(tmp) / "build"), threads)
        reports = [torch.load(Path(tmp) / f"build.{rank}") for rank in range(world)]
    return {label: [r[label] for r in reports] for label in runs}


def check(reports: list[dict], eager: dict, stage_names: list[list[str]]) -> tuple[str, bool]:
    """A line of figures for one layout's reports and whether every check holds."""
    from tests.pipeline.workers_build import holder_counts, rank_findings

    found = [rank_findings(r, eager, stage_names[r["stage"]]) for r in reports]
    names = sum(f["names"] and f["only_held"] for f in found)
    equal, held = sum(f["equal"] for f in found), sum(f["held"] for f in found)
    holders = holder_counts(reports)
    per_stage = len(reports) // reports[0]["pp"]
    shared = sorted(n for n, count in holders.items() if count != per_stage)
    covers = set(holders) == set(eager) and shared == ["embed.weight"] and holders[shared[0]] == 2 * per_stage
    line = (f"{len(reports)} ranks, {names} hold exactly their stage's names with nothing else allocated; "
            f"{equal}/{held} held parameters bit-identical to the eager build; stages cover {len(holders)}/"
            f"{len(eager)} parameters, shared by first and last: {shared}")
    return line, names == len(reports) and equal == held and covers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=process_counts, default="1,2", help="torch threads per process")
    parser.add_argument("--precisions", default="fp64,fp32", help="comma-separated: fp64, fp32")
    args = parser.parse_args()
    import torch

    from megaloop.config import load_config
    from megaloop.model import build_model
    from megaloop.model.stages import stage_parameter_names
    from tests.pipeline.test_stage_build import DTYPES, SEED, TINY, trainer_overrides

    precisions = args.precisions.split(",")
    if not set(precisions) <= set(DTYPES):
        parser.error(f"--precisions {args.precisions!r}: use a comma-separated subset of {sorted(DTYPES)}")
    torch.set_num_threads(1)
    cfg = load_config(TINY, trainer_overrides(2, 1, "fp64")).model
    meta = build_model(cfg, device="meta")
    ok = True
    for threads in args.threads:
        for world in sorted({w for _, _, w in LAYOUTS.values()}):
            runs = {(label, precision): trainer_overrides(pp, tp, precision)
                    for label, (pp, tp, w) in LAYOUTS.items() if w == world for precision in precisions}
            for (label, precision), reports in run_world(world, runs, threads).items():
                pp = LAYOUTS[label][0]
                eager = dict(build_model(cfg, seed=SEED).to(DTYPES[precision]).named_parameters())
                line, good = check(reports, eager, [stage_parameter_names(meta, s, pp) for s in range(pp)])
                ok &= good
                print(f"{label:>12} {precision} {threads} thread(s): {line}{'' if good else '  <-- FAILED'}",
                      flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
