"""When a job stops early, agreed by every rank: a signal (preemption, Ctrl-C, scancel) or the job's time budget.

SIGINT, SIGTERM or SIGUSR1 on any rank, or the time budget running out on any rank, make every rank stop at the same
step boundary: each rank puts :meth:`StopRequests.local_code` into its step's packed statistics (one reduction over
the job per step, which the step makes anyway) and every rank then calls :meth:`StopRequests.decide` with the
reduced code, so a signal that reached one rank first stops all of them after that step.
The trainer then saves and exits with checkpointing.STOP_EXIT_CODE. A second signal aborts at once.

Start-up. The handlers are installed when the job starts (`python -m megaloop train` installs
:func:`hold_early_signals` before anything else; train() then enters StopRequests before the process groups, the
data, the build and the restore), not only around the steps. A signal before the first step raises
:class:`StartupStop` at once: there is nothing to save (the last committed checkpoint is where a re-run continues),
so the job exits with STOP_EXIT_CODE within a moment instead of finishing a minutes-long build or restore, or dying
of USR1's default action. :meth:`StopRequests.begin_steps` ends the start-up: from there a signal only asks for the
agreed stop above.

The time budget: `train.time_limit_s` seconds from the start of training, and the unix time in the environment
variable MEGALOOP_DEADLINE (a batch script exports its job's end time), whichever comes first. The job stops when
the time left is less than two of its slowest steps plus its slowest save so far, so that the checkpoint lands in
time.
"""
from __future__ import annotations

import os
import signal
import time

from megaloop.config import ConfigError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# stop codes, summed over the job as one slot per code (megaloop.train.step): every rank learns which signal stopped
# the job, not only that one did, so the STOPPED marker names it whichever rank it reached
TIME_LIMIT_CODE = 2
SIGNAL_CODES = {signal.SIGINT: 3, signal.SIGTERM: 4, signal.SIGUSR1: 5}
REASONS = {1: "signal", TIME_LIMIT_CODE: "time limit", **{c: s.name for s, c in SIGNAL_CODES.items()}}
# not a stop: some rank's checkpoint.every_minutes interval has run out, so every rank saves after this step
# (megaloop.train.cadence); a stop code on any rank outranks it (the stop saves anyway)
SAVE_DUE_CODE = max(REASONS) + 1
STOP_CODES = SAVE_DUE_CODE  # codes 1..STOP_CODES, one slot each in the step's reduction
_EARLY: list[str] = []  # signals received before StopRequests took over (see hold_early_signals)


def early_signal() -> str | None:
    """The first stop signal hold_early_signals noted (None: none yet)."""
    return _EARLY[0] if _EARLY else None


class StartupStop(BaseException):
    """A stop signal arrived during start-up (process groups, build, restore): nothing to save, exit 75. A
    BaseException, like KeyboardInterrupt, so that no `except Exception` on the way swallows it."""

    def __init__(self, signal_name: str):
        super().__init__(f"{signal_name} during start-up")
        self.signal_name = signal_name


def hold_early_signals() -> None:
    """From process start until StopRequests is entered: note a stop signal instead of dying of it (USR1's default
    action ends the process); StopRequests.__enter__ then raises StartupStop for it."""
    def note(signum, frame):
        _EARLY.append(signal.Signals(signum).name)

    for sig in STOP_SIGNALS:
        try:
            signal.signal(sig, note)
        except ValueError:  # not the main thread
            pass


def deadline_from(time_limit_s: float | None, environ=None, now: float | None = None) -> float | None:
    """The wall-clock time (time.time()) by which this job must have saved, or None."""
    env = os.environ if environ is None else environ
    now = time.time() if now is None else now
    candidates = [now + time_limit_s] if time_limit_s is not None else []
    if env.get("MEGALOOP_DEADLINE"):
        try:
            candidates.append(float(env["MEGALOOP_DEADLINE"]))
        except ValueError:
            raise ConfigError("MEGALOOP_DEADLINE (environment)", env["MEGALOOP_DEADLINE"], "must be a unix time in "
                              "seconds; unset it or export e.g. $(date -d '+1 hour' +%s)") from None
    return min(candidates) if candidates else None


class StopRequests:
    """Signal handlers and the time budget of one training job; see the module docstring."""

    def __init__(self, deadline: float | None = None, starting: bool = False):
        self.deadline = deadline
        self.starting = starting  # a signal now raises StartupStop (until begin_steps)
        self.signal_name: str | None = None
        self.signal_code = 1  # this rank's signal as a stop code (SIGNAL_CODES)
        self.reason: str | None = None
        self.slowest_step = 0.0
        self.slowest_save = 0.0
        self._signalled = False
        self._old = {}

    def begin_steps(self, deadline: float | None) -> None:
        """The first step is next: from now on a signal asks for the agreed stop (and the time budget counts)."""
        self.starting = False
        self.deadline = deadline

    def note_step(self, seconds: float) -> None:
        self.slowest_step = max(self.slowest_step, seconds)

    def note_save(self, seconds: float) -> None:
        self.slowest_save = max(self.slowest_save, seconds)

    def local_code(self) -> int:
        """This rank's reason to stop now: 0 none, its signal's code (SIGNAL_CODES), or TIME_LIMIT_CODE."""
        if self._signalled:
            return self.signal_code
        if self.deadline is not None and time.time() + 2 * self.slowest_step + self.slowest_save >= self.deadline:
            return TIME_LIMIT_CODE
        return 0

    def decide(self, code: int) -> bool:
        """Whether to stop, from the job-wide code of this step's reduction (the same on every rank)."""
        if code == SAVE_DUE_CODE:
            return False
        if code:
            self.reason = self.signal_name if code == 1 and self.signal_name else REASONS[code]
        return bool(code)


    def __enter__(self):
        for sig in STOP_SIGNALS:
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        if _EARLY and self.starting:
            self._signalled, self.signal_name = True, _EARLY[0]
            _EARLY.clear()
            self.__exit__()
            raise StartupStop(self.signal_name)
        return self

    def _handle(self, signum, frame):
        if self._signalled:  # a second signal aborts at once
            raise KeyboardInterrupt
        self._signalled = True
        self.signal_name = signal.Signals(signum).name
        self.signal_code = SIGNAL_CODES.get(signal.Signals(signum), 1)
        if self.starting:
            raise StartupStop(self.signal_name)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def job_stop_code(ranks_per_code) -> int:
    """The job-wide code from the number of ranks that stop with each code 1..STOP_CODES: a signal's (the first
    of SIGNAL_CODES' order that some rank received) before the time limit, and any stop before SAVE_DUE_CODE."""
    counts = dict(zip(range(1, STOP_CODES + 1), ranks_per_code))
    for code in (*SIGNAL_CODES.values(), 1, TIME_LIMIT_CODE, SAVE_DUE_CODE):
        if counts.get(code, 0) > 0:
            return code
    return 0
