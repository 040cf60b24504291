"""Questions to megaloop, asked in a child process with the interpreter that renders the job (this package never
imports megaloop: it renders commands that run megaloop's entry points).

check(): `python -m megaloop check CONFIG --set ...` with WORLD_SIZE set to the job's process count validates the
whole config, the parallel layout and the data directory before a job waits in a queue for hours.

costs(): training FLOPs per token at each mu_rec of a sweep, from megaloop's own FLOP model: `python -m megaloop flops CONFIG --json --set ...` prints one JSON object
{"flops_per_token": F, "tokens_per_step": global_batch_size * seq_len, "mu_rec": M, "mu_bwd": K}. Where that command does not exist yet,
the same numbers come from a short child program that calls megaloop.train.flops.FlopModel directly: the FLOPs of
one token at the nominal depth, mu_rec - mu_bwd loop steps without and mu_bwd (model.backprop_depth) with gradient.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass


class FlopsError(RuntimeError):
    pass


def check(config: str, overrides: list[str], world_size: int, python: str = sys.executable) -> str | None:
    """megaloop's one-line complaint about the config in a job of `world_size` processes, or None when it is valid."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_PROCID")}
    env["WORLD_SIZE"] = str(world_size)
    done = subprocess.run([python, "-m", "megaloop", "check", config] + [a for o in overrides for a in ("--set", o)],
                          capture_output=True, text=True, env=env)
    return None if done.returncode == 0 else _last_line(done.stderr)


@dataclass(frozen=True)
class Cost:
    flops_per_token: float
    tokens_per_step: int  # data.global_batch_size * model.seq_len
    mu_bwd: int  # the loop steps with gradient (model.backprop_depth) at this mu_rec


_FALLBACK = r"""
import json, sys
from megaloop.config import load_config
from megaloop.train.flops import FlopModel
config, runs = sys.argv[1], json.loads(sys.argv[2])
for overrides in runs:
    cfg = load_config(config, overrides, validate=False)  # the data directory need not exist here
    m = cfg.model
    m.validate()
    k = m.backprop_depth if m.is_looped else 0
    n = m.mu_rec - k if m.is_looped else 0
    print(json.dumps({"flops_per_token": FlopModel.of(m).per_token(n, k),
                      "tokens_per_step": cfg.data.global_batch_size * m.seq_len,
                      "mu_rec": m.mu_rec, "mu_bwd": k}))
"""


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


def costs(config: str, overrides: list[str], mu_values: list[int], python: str = sys.executable) -> dict[int, Cost]:
    """mu_rec -> Cost for the config with the user's overrides and model.mu_rec set to each value."""
    runs = [list(overrides) + [f"model.mu_rec={mu}"] for mu in mu_values]
    first = _run([python, "-m", "megaloop", "flops", config, "--json"] + [a for o in runs[0] for a in ("--set", o)])
    if first.returncode == 0:
        answers = [first.stdout] + [_checked([python, "-m", "megaloop", "flops", config, "--json"] +
                                             [a for o in run for a in ("--set", o)]) for run in runs[1:]]
    elif "invalid choice" in first.stderr:  # no `flops` command: ask the FLOP model directly
        answers = _checked([python, "-c", _FALLBACK, config, json.dumps(runs)]).splitlines()
    else:
        raise FlopsError(f"megaloop could not compute FLOPs per token: {_last_line(first.stderr)}")
    out = {}
    for mu, text in zip(mu_values, answers):
        record = json.loads(_last_line(text))
        out[mu] = Cost(float(record["flops_per_token"]), int(record["tokens_per_step"]), int(record["mu_bwd"]))
    return out


def _checked(cmd: list[str]) -> str:
    done = _run(cmd)
    if done.returncode != 0:
        raise FlopsError(f"megaloop could not compute FLOPs per token: {_last_line(done.stderr)}")
    return done.stdout
