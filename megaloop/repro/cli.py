"""`python -m megaloop repro`: train the studies' points (locally in parallel, or as Slurm jobs), evaluate them and
write the report OUT.md with its figures in OUT/ (default docs/reproduction.md and docs/reproduction/*.png).

Run folders, shards and checkpoints go under --work (default runs/reproduction, outside git); only the report and
its PNGs are meant to be committed. Re-running the same command skips finished points and resumes interrupted ones;
--report-only re-renders the report from the artifacts without training."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from megaloop.config import ConfigError
from data_prep.paths import LocalPath

HELP = ("reproduce the paper's claims at CPU scale: train the studies' points, evaluate them and write "
        "docs/reproduction.md, every number naming the run artifact it came from")
REPO = Path(__file__).resolve().parents[2]
FULL_MINUTES = 50.0  # the studies' full sizes (budget 1) take about this long on an idle 2-core machine
DEFAULT_MINUTES = 25.0  # the default (and the committed report's) budget: half the full sizes' steps
SYNTH_FULL_MINUTES = 50.0  # --testbed synth: its full sizes, which are also its default and its committed report's


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--budget-minutes", type=float, default=None, metavar="M",
                   help=f"scale the full studies' training steps so that the whole report takes about M minutes "
                        f"on 2 idle cores (default {DEFAULT_MINUTES:g}, the committed report's; the studies' "
                        f"full sizes are {FULL_MINUTES:g}; --testbed synth: default and full "
                        f"{SYNTH_FULL_MINUTES:g})")
    p.add_argument("--out", type=LocalPath(), default="docs/reproduction", metavar="DIR",
                   help="the report is DIR.md, its figures DIR/*.png (default docs/reproduction)")
    p.add_argument("--work", type=LocalPath(), default="runs/reproduction", metavar="DIR",
                   help="run folders, shards and checkpoints (default runs/reproduction; not for git)")
    p.add_argument("--smoke", action="store_true", help="toy sizes: every study in a few minutes (CI)")
    p.add_argument("--testbed", choices=("corpus", "synth"), default="corpus",
                   help="corpus (default): the studies on the text corpus, as the paper; synth: k-hop pointer "
                        "chasing (`data_prep synth`), where the answer needs sequential steps and the loop has work "
                        f"to do (its own studies f..i, full sizes about {SYNTH_FULL_MINUTES:g} minutes on 2 idle "
                        "cores; its sections go into the same report, between markers)")
    p.add_argument("--studies", default=None, metavar="NAME,...",
                   help="studies to run and report, by name or letter: stability (a), depth_sampling (b), "
                        "testtime (c), isoflop (d), throughput (e); with --testbed synth: synth_depth (f), "
                        "synth_sampling (g), synth_stability (h), synth_isoflop (i); default all of the testbed's")
    p.add_argument("--report-only", action="store_true", help="re-render the report from existing run artifacts")
    p.add_argument("--corpus", type=LocalPath(), default=str(REPO.parent / "shared" / "data" / "corpus"),
                   metavar="PATH",
                   help="directory of .txt files to train on (default ../shared/data/corpus beside the checkout)")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="training processes at once (default: the number of cores); each gets cores/N threads")
    p.add_argument("--slurm", default=None, metavar="ARGS",
                   help="submit each training point as a Slurm job with `python -m slurm submit ARGS`, e.g. "
                        "--slurm '--partition cpu --time 30'; run the same command again after the jobs end to "
                        "evaluate and write the report")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _check(args) -> None:
    if args.budget_minutes is not None and not args.budget_minutes > 0:
        raise ConfigError("--budget-minutes", args.budget_minutes, "must be > 0 minutes")
    if args.smoke and args.budget_minutes is not None:
        raise ConfigError("--budget-minutes", args.budget_minutes, "applies to the full studies; drop it or --smoke")
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError("--jobs", args.jobs, "must be >= 1")
    if args.slurm is not None and args.report_only:
        raise ConfigError("--slurm", args.slurm, "submits training; --report-only trains nothing: choose one")


def canonical_command(args, studies: list[str]) -> str:
    """The command that makes this report, without machine paths (what the report's header names)."""
    parts = ["python -m megaloop repro"]
    if args.testbed != "corpus":
        parts.append(f"--testbed {args.testbed}")
    if args.smoke:
        parts.append("--smoke")
    if args.budget_minutes is not None:
        parts.append(f"--budget-minutes {args.budget_minutes:g}")
    from megaloop.repro import registry

    if studies != [name for name, _, _ in registry.studies_of(args.testbed)]:
        parts.append(f"--studies {','.join(studies)}")
    return " ".join(parts)


def run_repro(args) -> int:
    from megaloop.repro import registry, runner, shards
    from megaloop.repro.artifacts import MissingArtifact, RunArtifacts
    from megaloop.repro.report import render
    from megaloop.repro.sizes import make_scale

    _check(args)
    studies = registry.parse_selection(args.studies, args.testbed)
    loaded = {name: registry.load(name) for name in studies}
    work = Path(args.work).resolve()
    jobs = args.jobs or os.cpu_count() or 1
    if args.testbed == "synth":
        budget = (SYNTH_FULL_MINUTES if args.budget_minutes is None else args.budget_minutes) / SYNTH_FULL_MINUTES
    else:
        budget = (DEFAULT_MINUTES if args.budget_minutes is None else args.budget_minutes) / FULL_MINUTES
    scale = make_scale("smoke" if args.smoke else "full", Path(args.corpus).resolve(), work, jobs, budget,
                       args.testbed)
    points = {name: study.points(scale) for name, study in loaded.items()}
    dirs = {name: [runner.run_dir(scale, p) for p in pts] for name, pts in points.items()}
    if not args.report_only:
        data = shards.prepare(scale)
        unique = {runner.run_dir(scale, p): p for pts in points.values() for p in pts}  # a study may read another's
        plans = [runner.plan_point(p, scale, data) for p in unique.values()]
        if args.slurm is not None:
            from megaloop.repro.slurm_submit import submit

            pending = submit(plans, scale, data, args.slurm, jobs, not args.no_progress)
            if pending:
                print(f"megaloop repro: {pending} point(s) are Slurm jobs that have not finished; run the same "
                      "command again after they end to evaluate them and write the report", file=sys.stderr)
                return 0
        else:
            runner.Runner(scale, data, jobs, progress=not args.no_progress).run(plans)
    try:
        report = render(scale, studies, Path(args.out).resolve(), canonical_command(args, studies), dirs,
                        RunArtifacts(scale))
    except MissingArtifact as err:
        raise ConfigError("--report-only" if args.report_only else "--work", str(work), str(err)) from None
    print(f"megaloop repro: wrote {report}")
    return 0


def main(args) -> int:
    """Exit codes: 0 done, 2 bad input (one line), 75 stopped on request (run again to continue), 1 a point failed."""
    from megaloop.repro.runner import PointFailed, Stopped

    try:
        return run_repro(args)
    except Stopped as err:
        print(f"megaloop repro: {err}", file=sys.stderr)
        return 75
    except PointFailed as err:
        print(f"megaloop repro: {err}", file=sys.stderr)
        return 1


def slurm_words(text: str) -> list[str]:
    return shlex.split(text)
