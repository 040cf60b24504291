"""`python -m slurm.agent [torchrun options] -m megaloop train ...`: torchrun as the batch script starts it, one per
node, with the stop signals left to the workers.

Slurm delivers a stop to EVERY process of a job step: the USR1 that the batch script forwards through srun, and the
SIGTERM of a cancellation, a preemption or the time limit. Plain torchrun dies of SIGUSR1 (Python's default action),
and answers SIGTERM or SIGINT by sending SIGTERM to each worker once more; the trainer takes a second signal as
"abort now" rather than "save". Here the agent only notes those signals and keeps watching its workers, which have
received the signal directly: they agree on one step, save a checkpoint and exit with the trainer's stop code (75).

Exit code: 0 when every worker exited 0, or after an agreed stop: some worker exited with the stop code and every
other one that failed did too or was ended by SIGTERM (torchrun terminates the rest of its workers as soon as the
first one exits non-zero; by then the checkpoint is committed). A non-zero code there would make
`srun --kill-on-bad-exit` kill the other nodes while rank 0 may still be writing its STOPPED marker; the batch script
reads the outcome from the markers. Otherwise 1, as torchrun.
Imports torch only, never megaloop."""
from __future__ import annotations

import signal
import sys

STOP_EXIT_CODE = 75  # megaloop.train.checkpointing.STOP_EXIT_CODE (this package must not import megaloop)
LEFT_TO_WORKERS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


def _note(signum, frame) -> None:
    print(f"[slurm.agent] {signal.Signals(signum).name}: left to the workers (they stop at an agreed step and save)",
          file=sys.stderr, flush=True)


def agreed_stop(codes: list[int]) -> bool:
    """The failed workers' exit codes (negative: the signal that ended them) tell an agreed stop."""
    return STOP_EXIT_CODE in codes and set(codes) <= {STOP_EXIT_CODE, -signal.SIGTERM}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    for sig in LEFT_TO_WORKERS:  # a Python handler, not SIG_IGN: exec() resets it, so workers start with defaults
        signal.signal(sig, _note)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:  # torchrun installs its own handlers only for the signals listed here
        torchrun(["--signals-to-handle=SIGHUP,SIGQUIT", *argv])
    except ChildFailedError as err:
        codes = sorted({f.exitcode for f in err.failures.values()})
        if agreed_stop(codes):
            print(f"[slurm.agent] workers stopped at an agreed step (exit {STOP_EXIT_CODE})", file=sys.stderr,
                  flush=True)
            return 0
        print(f"[slurm.agent] workers failed with exit codes {codes} (negative: killed by that signal)",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
