"""megaloop command line: `python -m megaloop train|check|flops|bench|launch|plan CONFIG [--set key=value ...]`,
`python -m megaloop peak` (the CPU peak MFU divides by), `python -m megaloop preflight` (every communication
path of a job, checked and timed), `python -m megaloop eval|generate CHECKPOINT` (evaluation and sampling),
`python -m megaloop laws fit` (scaling laws with intervals), `python -m megaloop plot RUN_DIR` (a run's curves
as PNGs), `python -m megaloop repro` (the paper's claims reproduced from runs, docs/reproduction.md) and
`python -m megaloop status RUN_DIR` (a running or finished run's ranks, stragglers, hung ranks and restarts)."""
from __future__ import annotations

import argparse
import sys
from data_prep.paths import LocalPath


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megaloop", description="Pretraining of stable looped (Parcae) language models.")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, help_text in (("train", "train a model from a YAML config"),
                            ("check", "validate a config and print the resolved tree and model size, then exit")):
        _config_args(sub.add_parser(name, help=help_text, description=help_text))
    from megaloop.train import flops_cli

    flops_cli.add_arguments(_config_args(sub.add_parser("flops", help=flops_cli.HELP, description=flops_cli.HELP)))
    from megaloop.train import bench

    bench.add_arguments(_config_args(sub.add_parser("bench", help=bench.HELP, description=bench.HELP + ", e.g. "
                                                    "`python -m megaloop bench configs/parcae-tiny.yaml --steps 10 "
                                                    "--set data.shards=runs/quickstart/shards`")))
    launch = "check the config for N processes, then train on them with torchrun --standalone (one machine)"
    p = _config_args(sub.add_parser("launch", help=launch, description=launch + ": a bad config is one line and exit "
                                    "code 2 before any process starts, e.g. `python -m megaloop launch "
                                    "--nproc-per-node 4 configs/parcae-tiny.yaml --set parallel.tp=2`"))
    p.add_argument("--nproc-per-node", type=int, required=True, metavar="N", help="processes to start")
    plan = ("print the per-GPU memory of a job (parameters, gradients, optimizer state, activations under each "
            "train.activation_checkpointing) and the largest micro-batch that fits")
    from megaloop.plan.cli import add_arguments

    add_arguments(_config_args(sub.add_parser("plan", help=plan, description=plan + ", e.g. `python -m megaloop "
                                              "plan configs/parcae-1_3b.yaml --gpu h100 --nodes 1 "
                                              "--gpus-per-node 8`")))
    from megaloop.train import peak_cli

    peak_cli.add_arguments(sub.add_parser("peak", help=peak_cli.HELP, description=peak_cli.HELP))
    from megaloop.preflight import cli as preflight_cli

    preflight_cli.add_arguments(sub.add_parser("preflight", help=preflight_cli.HELP,
                                               description=preflight_cli.HELP + ". " + preflight_cli.EXIT_CODES))
    from megaloop.eval import cli as eval_cli, generate_cli
    from megaloop.laws import cli as laws_cli
    from megaloop.train import plots

    eval_cli.add_arguments(sub.add_parser("eval", help=eval_cli.HELP, description=eval_cli.HELP))
    generate_cli.add_arguments(sub.add_parser("generate", help=generate_cli.HELP, description=generate_cli.HELP))
    laws_cli.add_arguments(sub.add_parser("laws", help=laws_cli.HELP, description=laws_cli.HELP))
    plots.add_arguments(sub.add_parser("plot", help=plots.HELP, description=plots.HELP))
    from megaloop.repro import cli as repro_cli

    repro_cli.add_arguments(sub.add_parser("repro", help=repro_cli.HELP, description=repro_cli.HELP))
    from megaloop.status import cli as status_cli

    status_cli.add_arguments(sub.add_parser("status", help=status_cli.HELP, description=status_cli.HELP + ". "
                                            + status_cli.RULES))
    return ap


def _config_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("config", type=LocalPath(), help="YAML config, e.g. configs/parcae-tiny.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config value, e.g. --set train.steps=100 (repeatable)")
    return p


def _world_size(command: str) -> int | None:
    """The job's process count from the launcher (torchrun, mpirun, Slurm). A plain `train` is a job of one process;
    `check` of a config meant for a multi-process job, run without a launcher, checks everything but the layout."""
    import os

    from megaloop.config import ConfigError

    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):  # the order of read_launch_env
        if var in os.environ:
            try:
                return int(os.environ[var])
            except ValueError:
                raise ConfigError(f"${var}", os.environ[var], "the launcher's process count must be an integer; "
                                  f"unset {var} or launch with torchrun/srun") from None
    return 1 if command == "train" else None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from megaloop.config import ConfigError, load_config

    try:
        if args.command == "flops":
            from megaloop.train.flops_cli import run_flops

            return run_flops(args, load_config(args.config, args.overrides, validate=False))
        if args.command == "launch":
            return _launch(args)
        if args.command == "bench":
            from megaloop.train.bench import run_bench

            return run_bench(args)
        if args.command == "peak":
            from megaloop.train.peak_cli import run_peak

            return run_peak(args)
        if args.command == "preflight":
            from megaloop.preflight.cli import run_preflight

            return run_preflight(args)
        if args.command in ("eval", "generate"):
            from megaloop.eval import cli as eval_cli, generate_cli

            return (eval_cli.run_eval if args.command == "eval" else generate_cli.run_generate)(args)
        if args.command == "laws":
            from megaloop.laws.cli import run_laws

            return run_laws(args)
        if args.command == "plot":
            from megaloop.train.plots import run_plot

            return run_plot(args)
        if args.command == "repro":
            from megaloop.repro.cli import main as run_repro

            return run_repro(args)
        if args.command == "status":
            from megaloop.status.cli import run_status

            return run_status(args)
        if args.command == "plan":
            from megaloop.plan.cli import run_plan

            return run_plan(args)
        cfg = load_config(args.config, args.overrides, world_size=_world_size(args.command))
    except (ConfigError, FileNotFoundError) as err:
        print(f"megaloop: {err}", file=sys.stderr)
        return 2
    if args.command == "check":
        try:
            return _check(cfg)
        except BrokenPipeError:  # `check ... | head`: the reader went away; stop quietly
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
    from megaloop.train.cli import run_training

    return run_training(cfg)


def _launch(args) -> int:
    """Validate the config for the job's world size, then train under torchrun's agent (megaloop.launch)."""
    from megaloop.launch import run_launch

    return run_launch(args)


def _check(cfg) -> int:
    import json

    from megaloop.model import build_model, count_parameters

    from megaloop.config.budget import budget_line

    n = count_parameters(build_model(cfg.model, device="meta"))
    print(json.dumps(cfg.to_dict(), indent=2))
    print(f"model: {n / 1e6:.2f}M parameters")
    print(f"run: {budget_line(cfg)}")
    o = cfg.optim
    rates = (f"Muon (matrices) lr {o.matrix_lr:g}, AdamW (the rest) lr {o.adam_lr:g}" if o.name == "muon"
             else f"AdamW lr {o.adam_lr:g}")
    print(f"optimizer: {o.name}: {rates}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] in (["train"], ["launch"]):  # from process start: a stop signal during the imports is noted,
        from megaloop.train.stopping import hold_early_signals  # then ends the start-up with exit 75 (see there)

        hold_early_signals()
    sys.exit(main())
