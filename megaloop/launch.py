"""`python -m megaloop launch`: check the config for N processes, then run torchrun's agent in this process.

A bad config is one line and exit code 2 before any process starts (torchrun's traceback would follow the ranks'
one-line errors). The agent (torch.distributed.run) starts the workers in their own sessions and forwards SIGINT,
SIGTERM and SIGUSR1 to them once (Ctrl-C in the terminal reaches only this process), waiting up to
SHUTDOWN_TIMEOUT_S for them to save. When the workers stopped cleanly (an agreed stop: a signal, train.stop_at_step,
the time budget) this command says so in one line and exits with their code, 75, where torchrun itself would exit 1
with a traceback. A stop is clean when rank 0 left a STOPPED marker in train.out_dir during this launch (written
after the checkpoint was committed, before any rank exits) or every worker that failed exited 75, and no worker
failed otherwise (a rank the agent terminated after another one exited does not count). Workers that refuse their
input (exit code 2: bad data, a checkpoint that does not fit) leave their one-line error in a folder this command
made, instead of printing it once per rank; it shows each distinct line once and exits 2.
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from megaloop.train.cli import ERROR_DIR_ENV

SHUTDOWN_TIMEOUT_S = 300  # the workers' time to finish the step and save after a forwarded signal
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGUSR1,SIGHUP,SIGQUIT"
BAD_INPUT_EXIT_CODE = 2  # a worker's one-line refusal of its config or data (megaloop.train.cli.report_bad_input)


def run_launch(args) -> int:
    """Validate, then train on args.nproc_per_node local processes; returns the exit code (0, 75, or a failure)."""
    from megaloop.config import ConfigError, load_config
    from megaloop.train.checkpointing import STOP_EXIT_CODE

    if args.nproc_per_node < 1:
        raise ConfigError("--nproc-per-node", args.nproc_per_node, "must be >= 1")
    cfg = load_config(args.config, args.overrides, world_size=args.nproc_per_node)
    sets = [a for o in args.overrides for a in ("--set", o)]
    torchrun = ["--standalone", "--nproc-per-node", str(args.nproc_per_node), "--signals-to-handle", FORWARDED_SIGNALS,
                "-m", "megaloop", "train", args.config, *sets]
    if "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ:
        torchrun[:0] = ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    sys.stdout.flush()
    from megaloop.train.stopping import early_signal

    if early_signal() is not None:  # a stop signal before any worker started (the agent handles them from here)
        print(f"megaloop launch: stopped by {early_signal()} before the workers started; run the same command again "
              f"(exit code {STOP_EXIT_CODE})", file=sys.stderr, flush=True)
        return STOP_EXIT_CODE
    _quiet_clean_stops(STOP_EXIT_CODE)
    _quiet_clean_stops(BAD_INPUT_EXIT_CODE)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="megaloop-launch-errors-") as errors:
        os.environ[ERROR_DIR_ENV] = errors
        try:
            outcome = _run_agent(torchrun)
        finally:
            os.environ.pop(ERROR_DIR_ENV, None)
        if outcome is None:
            return 0
        codes, signum = outcome
        if BAD_INPUT_EXIT_CODE in codes and all(code in (BAD_INPUT_EXIT_CODE, STOP_EXIT_CODE) or code < 0
                                                for code in codes):  # the others stopped or were terminated
            return _show_bad_input(Path(errors))
    stop = _stopped_marker(Path(cfg.train.out_dir), started)
    clean = all(code == STOP_EXIT_CODE or code < 0 for code in codes) and (
        stop is not None or (codes and all(code == STOP_EXIT_CODE for code in codes)))
    if clean:
        saved = "" if stop and "during start-up" in stop else " and saved"  # a start-up stop has nothing to save
        print(f"megaloop launch: the workers stopped cleanly{' ' + stop if stop else ''}{saved}; run the same "
              f"command again to continue (exit code {STOP_EXIT_CODE})", file=sys.stderr, flush=True)
        return STOP_EXIT_CODE
    if signum is not None:
        print(f"megaloop launch: stopped by {signal.Signals(signum).name} before the workers saved; run the same "
              "command again to continue from the last committed checkpoint", file=sys.stderr, flush=True)
        return 128 + signum
    print(f"megaloop launch: a worker failed (exit codes {sorted(set(codes))}; its error is above); fix it and run "
          "the same command again", file=sys.stderr, flush=True)
    return 1


def _show_bad_input(errors: Path) -> int:
    """Every worker stopped on bad input (exit code 2): each distinct error line once (with the ranks when they
    differ), and exit code 2."""
    lines: dict[str, list[str]] = {}
    for path in sorted(errors.glob("rank*.txt"), key=lambda p: int(p.stem[4:] or 0)):
        lines.setdefault(path.read_text().strip(), []).append(path.stem[4:])
    if not lines:
        print("megaloop launch: the workers refused their input (exit code 2) without saying why; run `python -m "
              "megaloop train` with the same arguments to see the error", file=sys.stderr, flush=True)
    for line, ranks in lines.items():
        where = f" (rank {', '.join(ranks)})" if len(lines) > 1 else ""
        print(f"{line}{where}", file=sys.stderr, flush=True)
    return BAD_INPUT_EXIT_CODE


def _run_agent(torchrun_args: list[str]) -> tuple[list[int], int | None] | None:
    """Run torchrun's agent here; None when every worker succeeded, else (the failed workers' exit codes, the
    signal this process received or None)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(torchrun_args))
    except ChildFailedError as err:
        return [failure.exitcode for failure in err.failures.values()], None
    except SignalException as err:
        return [], int(err.sigval)
    return None


class _DropExitCode:
    """A logging filter dropping the agent's 'failed (exitcode: N)' record for one exit code."""

    def __init__(self, code: int):
        self.text = f"exitcode: {code})"

    def filter(self, record) -> bool:
        return self.text not in record.getMessage()


def _quiet_clean_stops(code: int) -> None:
    """The agent logs every worker that exited non-zero as failed; a stop is reported by run_launch instead."""
    import logging

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_DropExitCode(code))
    # the agent ending the other workers once one has exited: this command reports the outcome in its own line
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        lambda record: "closing signal" not in record.getMessage())


def _stopped_marker(out_dir: Path, since: float) -> str | None:
    """'after step N (reason)' from a STOPPED marker written since `since`, else None."""
    import json

    marker = out_dir / "STOPPED"
    try:
        if marker.stat().st_mtime < since - 1:
            return None
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return f"after step {info.get('step')} ({info.get('reason')})"
