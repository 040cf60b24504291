"""`python -m slurm.agent [--failures FILE] [--max-failures N] [torchrun options] -m megaloop train ...`: torchrun as
the batch script starts it, one per node, with the stop signals left to the workers and failed workers restarted.

Stops. Slurm delivers a stop to EVERY process of a job step: the USR1 that the batch script forwards through srun,
and the SIGTERM of a cancellation, a preemption or the time limit. Plain torchrun dies of SIGUSR1 (Python's default
action), and answers SIGTERM or SIGINT by sending SIGTERM to each worker once more; the trainer takes a second signal
as "abort now" rather than "save". Here the agent only notes those signals and keeps watching its workers, which
have received the signal directly: they agree on one step, save a checkpoint and exit with the trainer's stop code
(75).

Failures. torchrun runs with `--max-restarts`, and at each failure of its worker group (a worker died, raised, or
its peers' collectives timed out waiting for it) the agent decides before torchrun acts:
  - once a worker has failed, the others are ended with SIGKILL at once: torchrun's SIGTERM would read to the trainer
    as a stop request, and a stopped worker (SIGSTOP) cannot act on it at all (it is ended so even after an agreed
    stop), so no rank of a hung job outlives the collective timeout of the others by more than the agent's next look;
  - an agreed stop (exit 75), a stop signal the agent noted, or a refused input (exit code 2, which a restart cannot
    fix) is not restarted;
  - otherwise the failure goes into the run's failures.jsonl (--failures; slurm/failures.py: the rank blamed, its
    node, the cause) and torchrun restarts the group in a new rendezvous round, whose workers resume from the newest
    committed checkpoint. The failure that makes --max-failures within an hour (over the whole run, requeued jobs
    included) ends the agent instead, after a "gave_up" line with the reason, which the batch script prints.
With several nodes, the first agent of the failed round to get there writes the line (a counter in the round's
rendezvous store), so that a failure seen by every node counts once. The decision is taken in a subclass of
torchrun's LocalElasticAgent (its _monitor_workers), installed where torchrun's launcher looks the class up.

Exit code: 0 when every worker exited 0, or after an agreed stop: some worker exited with the stop code and every
other one that failed did too or was ended by SIGTERM (torchrun terminates the rest of its workers as soon as the
first one exits non-zero; by then the checkpoint is committed). A non-zero code there would make
`srun --kill-on-bad-exit` kill the other nodes while rank 0 may still be writing its STOPPED marker; the batch script
reads the outcome from the markers. Otherwise 1, as torchrun.
Imports torch only, never megaloop."""
from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

from slurm.failures import DEFAULT_MAX_FAILURES, FailureLog, WorkerOutcome, blame, describe, first_line

STOP_EXIT_CODE = 75  # megaloop.train.checkpointing.STOP_EXIT_CODE (this package must not import megaloop)
BAD_INPUT_EXIT_CODE = 2  # megaloop.train.cli.report_bad_input: a config or input the trainer refuses
LEFT_TO_WORKERS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
OWN_OPTIONS = ("--failures", "--max-failures")


def _say(message: str) -> None:
    print(f"[slurm.agent] {message}", file=sys.stderr, flush=True)


def agreed_stop(codes: list[int]) -> bool:
    """The failed workers' exit codes (negative: the signal that ended them) tell an agreed stop."""
    return STOP_EXIT_CODE in codes and set(codes) <= {STOP_EXIT_CODE, -signal.SIGTERM}


def process_status(pid: int | None) -> tuple[str, int | None]:
    """The kernel's one-letter state of a process (R, S, D, T stopped, t traced, Z exited but not yet reaped; "" when
    it is gone) and, for Z, its exit code as Popen gives it (negative: the signal that ended it)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError, TypeError):
        return "", None
    if fields[0] != "Z" or len(fields) < 50:
        return fields[0], None
    status = int(fields[49])  # field 52, exit_code: the wait status
    return "Z", -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF


class Recovery:
    """The agent's decisions at a failure of its worker group (see the module docstring). torchrun's poll ends the
    rest of the group as soon as it sees a worker fail (SIGTERM, SIGKILL 30 s later), so the group is looked at
    just before each poll (see look), and the failure is judged from that look (who exited how, who still ran), not
    from the exit codes of the workers ended afterwards."""

    def __init__(self, log: FailureLog | None):
        self.log = log
        self.stop_signal: int | None = None  # a stop signal the agent noted
        self.gave_up: str | None = None  # why the agent stopped restarting (None: it did not)
        self.node = socket.gethostname()
        self.seen: dict[int, tuple[str, int | None]] = {}  # rank -> process_status at the last look
        self.ended: set[int] = set()  # ranks ended with SIGKILL because they were stopped
        self.killed: set[int] = set()  # ranks ended with SIGKILL because another one failed (still running then)

    def note_stop(self, signum: int, frame=None) -> None:
        self.stop_signal = self.stop_signal or signum
        _say(f"{signal.Signals(signum).name}: left to the workers (they stop at an agreed step and save)")

    def look(self, group) -> None:
        """Before torchrun's poll: every worker's status. Once one has exited, the stopped ones get SIGKILL; once one
        has failed (not 0, not the stop code), so do all the others: torchrun's SIGTERM would read to the trainer as
        a stop request (during start-up it would even leave a STOPPED marker for a run that failed)."""
        self.seen = {w.global_rank: process_status(w.id) for w in group.workers}
        exited = {rank for rank, (state, _) in self.seen.items() if state == "Z"}
        if not exited:
            return
        failed = self.stop_signal is None and any(self.seen[r][1] not in (0, STOP_EXIT_CODE) for r in exited)
        for worker in group.workers:
            state = self.seen[worker.global_rank][0]
            stopped = state in ("T", "t")
            if state in ("Z", "") or not (stopped or failed) or worker.global_rank in self.ended | self.killed:
                continue
            try:
                os.kill(worker.id, signal.SIGKILL)
            except ProcessLookupError:
                continue
            if not stopped:
                self.killed.add(worker.global_rank)  # its own death is the agent's doing, not a cause
            if stopped:
                self.ended.add(worker.global_rank)
                _say(f"rank {worker.global_rank} (pid {worker.id}) is stopped and cannot take the SIGTERM that ends "
                     "its group: SIGKILL")

    def outcomes(self, group, result) -> list[WorkerOutcome]:
        """Each worker's outcome when the group failed: stopped (ended by the agent for it); still running (None)
        when the agent ended it because another one had failed; else its exit as the last look saw it (a zombie's
        code, with its error's first line) or, once torchrun has reaped it, as torchrun's poll noted it."""
        found = []
        for worker in group.workers:
            rank = worker.global_rank
            failure = result.failures.get(rank)
            message = first_line(failure.message) if failure is not None else ""
            state, code = self.seen.get(rank, ("", None))
            if rank in self.ended:
                found.append(WorkerOutcome(rank, self.node, None, stopped=True))
            elif rank in self.killed:
                found.append(WorkerOutcome(rank, self.node, None))
            elif state == "Z":
                found.append(WorkerOutcome(rank, self.node, code, False, message))
            elif failure is not None:
                found.append(WorkerOutcome(rank, self.node, failure.exitcode, False, message))
            else:
                found.append(WorkerOutcome(rank, self.node, None))
        return found

    def restart(self, group, result, round_: int) -> bool:
        """Whether torchrun may restart the group after this failure (see the module docstring)."""
        outcomes = self.outcomes(group, result)
        self.ended, self.killed = set(), set()
        codes = sorted({o.exitcode for o in outcomes if o.exitcode is not None})
        if self.stop_signal is not None or agreed_stop(codes):
            return False
        blamed = blame(outcomes)
        cause = describe(blamed) if blamed else "an unknown failure"
        where = f"rank {blamed.rank} on {blamed.node}" if blamed else "no rank named"
        first = _first_in_round(group)
        if BAD_INPUT_EXIT_CODE in codes:
            self.gave_up = (f"{where} refused its config or input (exit code {BAD_INPUT_EXIT_CODE}): a restart "
                            "cannot fix that; see the job's output")
            if first and self.log is not None:
                self.log.record(blamed, cause, "agent", round_)
                self.log.give_up(self.gave_up)
            return False
        if first and self.log is not None:
            self.gave_up = self.log.record(blamed, cause, "agent", round_)
        if self.gave_up:
            return False
        _say(f"the worker group failed: {cause} ({where}); restarting it from the newest committed checkpoint")
        return True


def _first_in_round(group) -> bool:
    """Whether this agent is the first of the failed round to report (always, on one node)."""
    if (group.group_world_size or 1) <= 1 or group.store is None:
        return True
    try:
        return group.store.add("megaloop/failure_reported", 1) == 1
    except Exception:  # the store went with its node: report it here rather than not at all
        return True


def install(recovery: Recovery) -> None:
    """Make torchrun's launcher build its agent as a LocalElasticAgent that asks `recovery` at each failure."""
    import torch.distributed.launcher.api as launcher
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class RecoveringAgent(LocalElasticAgent):
        def _monitor_workers(self, worker_group):
            recovery.look(worker_group)
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                round_ = worker_group.spec.max_restarts - self._remaining_restarts
                if not recovery.restart(worker_group, result, round_):
                    self._remaining_restarts = 0
            return result

    launcher.LocalElasticAgent = RecoveringAgent


def split_options(argv: list[str]) -> tuple[dict, list[str]]:
    """The agent's own leading options (--failures FILE, --max-failures N) and the rest, for torchrun."""
    own: dict = {"failures": None, "max_failures": DEFAULT_MAX_FAILURES}
    rest = list(argv)
    while rest and rest[0].split("=", 1)[0] in OWN_OPTIONS:
        key, eq, value = rest.pop(0).partition("=")
        if not eq:
            if not rest:
                raise SystemExit(f"slurm.agent: {key} needs a value")
            value = rest.pop(0)
        if key == "--failures":
            own["failures"] = value
        elif not value.isdigit() or int(value) < 1:
            raise SystemExit(f"slurm.agent: --max-failures {value!r}: must be an integer >= 1")
        else:
            own["max_failures"] = int(value)
    return own, rest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    own, rest = split_options(argv)
    log = FailureLog(Path(own["failures"]), own["max_failures"]) if own["failures"] else None
    recovery = Recovery(log)
    for sig in LEFT_TO_WORKERS:  # a Python handler, not SIG_IGN: exec() resets it, so workers start with defaults
        signal.signal(sig, recovery.note_stop)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # torch 2.13's c10d rendezvous shares one TCP store with the workers across restarts by default: the restarted
    # workers of a new round then find the previous round's keys in it (a dead peer's address) and fail to connect.
    # Unshared, each round's rank 0 worker hosts a fresh store on a free port.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    install(recovery)
    try:  # torchrun installs its own handlers only for the signals listed here
        torchrun(["--signals-to-handle=SIGHUP,SIGQUIT", *rest])
    except ChildFailedError as err:
        codes = sorted({f.exitcode for f in err.failures.values()})
        if recovery.gave_up:
            _say(f"giving up: {recovery.gave_up}")
            return 1
        if agreed_stop(codes):
            _say(f"workers stopped at an agreed step (exit {STOP_EXIT_CODE})")
            return 0
        _say(f"workers failed with exit codes {codes} (negative: killed by that signal)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
