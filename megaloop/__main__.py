"""megaloop command line: `python -m megaloop train CONFIG [--set key=value ...]`, `python -m megaloop check CONFIG`."""
from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megaloop", description="Pretraining of stable looped (Parcae) language models.")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, help_text in (("train", "train a model from a YAML config"),
                            ("check", "validate a config and print the resolved tree and model size, then exit")):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("config", help="YAML config, e.g. configs/parcae-tiny.yaml")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override one config value, e.g. --set train.steps=100 (repeatable)")
    return ap


def _world_size() -> int | None:
    import os

    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        if var in os.environ:
            return int(os.environ[var])
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from megaloop.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides, world_size=_world_size())
    except (ConfigError, FileNotFoundError) as err:
        print(f"megaloop: {err}", file=sys.stderr)
        return 2
    if args.command == "check":
        return _check(cfg)
    from megaloop.train.cli import run_training

    return run_training(cfg)


def _check(cfg) -> int:
    import json

    from megaloop.model import build_model, count_parameters

    n = count_parameters(build_model(cfg.model, device="meta"))
    print(json.dumps(cfg.to_dict(), indent=2))
    print(f"model: {n / 1e6:.2f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
