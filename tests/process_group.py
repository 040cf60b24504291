"""Run a command that starts processes of its own (torchrun, mpirun, a bash script) so that none of them outlives the
test: the command leads a new session (process group), and the whole group is killed when the command ends, times
out or the test is interrupted (pytest-timeout raises inside the wait)."""
from __future__ import annotations

import os
import signal
import subprocess


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL every process of proc's group (proc included); a group already gone is fine."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_group(cmd, timeout: float | None = None, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, ...) in a new session; on a timeout, an exception or its normal end, everything the command
    left running in its group is killed. Raises subprocess.TimeoutExpired like subprocess.run."""
    capture = kwargs.pop("capture_output", False)
    if capture:
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
