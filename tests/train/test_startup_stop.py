"""Start-up: a job that resumes allocates its parameters and loads them, with no initialisation (counted); a USR1
during the build (made slow on purpose) ends `python -m megaloop train` with exit 75 and a STOPPED marker at once,
and the re-run resumes from the last committed checkpoint."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from megaloop.config import load_config
from megaloop.train import build
from megaloop.train.loop import train
from megaloop.train.runtime import SingleProcessRuntime
from tests.train.conftest import TINY, fast_overrides

REPO = Path(__file__).resolve().parents[2]
STOP_EXIT_CODE = 75

# `python -m megaloop train ...` with a build that announces itself, then sleeps for a minute before building
SLOW_BUILD = """
import runpy, sys, time
import megaloop.train.loop as loop
real = loop.build_model_and_optimizer
def slow(*args, **kwargs):
    print("test: building", file=sys.stderr, flush=True)
    time.sleep(60)
    return real(*args, **kwargs)
loop.build_model_and_optimizer = slow
sys.argv = ["megaloop", *sys.argv[1:]]
runpy.run_module("megaloop", run_name="__main__")
"""


def counted_init(monkeypatch) -> list[str]:
    """The names megaloop.train.build initialises from now on (its init_parameter, wrapped)."""
    calls = []
    real = build.init_parameter

    def counting(cfg, name, *args, **kwargs):
        calls.append(name)
        return real(cfg, name, *args, **kwargs)

    monkeypatch.setattr(build, "init_parameter", counting)
    return calls


def run_in_process(shards, out: Path, steps: int, *extra: str):
    sets = fast_overrides(shards, out, steps) + ["train.val_depths=[2]", "data.val_batches=1", *extra]
    return train(load_config(str(TINY), sets), runtime=SingleProcessRuntime(torch.device("cpu")))


def test_usr1_during_the_build_exits_75_and_the_rerun_resumes_without_init(tiny_shards, tmp_path, monkeypatch):
    calls = counted_init(monkeypatch)
    first = run_in_process(tiny_shards, tmp_path, 4, "train.stop_at_step=2")
    assert first.interrupted and first.steps_done == 2
    fresh_calls = len(calls)
    assert fresh_calls == len(set(calls)) > 0  # a fresh job initialises every parameter, once

    sets = fast_overrides(tiny_shards, tmp_path, 4) + ["train.val_depths=[2]", "data.val_batches=1"]
    cmd = [sys.executable, "-c", SLOW_BUILD, "train", str(TINY), *[a for s in sets for a in ("--set", s)]]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = proc.stderr.readline()
        while line and "test: building" not in line:
            line = proc.stderr.readline()
        sent = time.monotonic()
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    took = time.monotonic() - sent
    assert proc.returncode == STOP_EXIT_CODE, err
    assert took < 30, took  # at once, not after the minute the build sleeps
    assert "stopped by SIGUSR1 during start-up, before the first step" in err and "Traceback" not in err, err
    assert json.loads((tmp_path / "STOPPED").read_text()) == {"step": 2, "reason": "SIGUSR1 during start-up",
                                                              "during": "start-up"}

    calls.clear()
    again = run_in_process(tiny_shards, tmp_path, 4)
    assert again.start_step == 2 and again.steps_done == 4 and not again.interrupted
    assert calls == [] and fresh_calls > 0  # the resumed build initialised nothing: the checkpoint filled it
    assert json.loads((tmp_path / "COMPLETED").read_text()) == {"step": 4}


def test_the_job_stop_code_names_the_signal_whichever_rank_had_it():
    from megaloop.train.stopping import SIGNAL_CODES, STOP_CODES, TIME_LIMIT_CODE, StopRequests, job_stop_code

    def counts(**by_code):
        return [by_code.get(f"c{code}", 0) for code in range(1, STOP_CODES + 1)]

    term, usr1 = SIGNAL_CODES[signal.SIGTERM], SIGNAL_CODES[signal.SIGUSR1]
    assert job_stop_code(counts()) == 0
    assert job_stop_code(counts(**{f"c{TIME_LIMIT_CODE}": 3})) == TIME_LIMIT_CODE
    assert job_stop_code(counts(**{f"c{TIME_LIMIT_CODE}": 3, f"c{usr1}": 1})) == usr1  # a signal before the time
    flag = StopRequests()  # rank 0: no signal of its own
    assert flag.decide(job_stop_code(counts(**{f"c{term}": 1}))) and flag.reason == "SIGTERM"
