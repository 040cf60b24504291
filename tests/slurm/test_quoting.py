"""User strings with spaces, both quotes, `$(...)`, backticks and `;` (job name, paths, config path, --set and --env
values, container image) are quoted in the rendered script and never executed: the script passes `bash -n`, and run
with fake srun/scontrol/squeue on PATH it hands every string to srun unchanged, while no `touch` inside them ever
runs. On the real cluster, sbatch reads the quoted `#SBATCH` lines back into the same job name and output path."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.jobs import TINY, job_state, slurm_cli, wait_gone


def nasty(tag: str, backslash: bool = False) -> str:
    """Every quoting hazard at once; each `touch` would create a file named pwned-<tag>... in the current folder.
    Names and paths that Slurm reads (job name, output folder) take no backslash (refused: Slurm's file-name
    patterns treat it specially); the other strings get one too."""
    extra = "\\$ " if backslash else ""
    return (f"{tag} a b 'c' \"d\" $(touch pwned-{tag}-1) `touch pwned-{tag}-2`; touch pwned-{tag}-3 "
            f"&& echo $HOME ${{x}} {extra}# e")


FAKE_SRUN = r"""#!__PYTHON__
import json, os, sys
from pathlib import Path
log = Path(os.environ["FAKE_LOG"])
log.joinpath("srun.json").write_text(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ)}))
out = [a.split("=", 1)[1] for a in sys.argv if a.startswith("train.out_dir=")][-1]
Path(out).mkdir(parents=True, exist_ok=True)
Path(out, "COMPLETED").write_text('{"step": 3}')
"""
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_LOG/calls"
if [ "$1 $2" = "show hostnames" ]; then echo node007; echo node008; fi
"""
FAKE_SQUEUE = """#!/bin/bash
echo 2030-01-02T03:04:05
"""


@pytest.fixture
def fakes(tmp_path):
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN.replace("__PYTHON__", sys.executable)), ("scontrol", FAKE_SCONTROL),
                       ("squeue", FAKE_SQUEUE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return bin_dir


def render(tmp_path: Path, work: Path) -> tuple[str, dict]:
    config = work / f"cfg {nasty('cfg')}.yaml"
    config.write_text(TINY.read_text())
    values = {
        "job_name": nasty("name"),
        "out_root": str(work / f"out {nasty('root')}"),
        "config": str(config),
        "set": f"data.shards=/data/{nasty('set', True)}",
        "set2": f"train.seed=1; {nasty('set2', True)}",
        "env": nasty("env"),
        "container": f"nvcr.io#nvidia/pytorch:25.01 {nasty('image', True)}",
        "python": str(work / f"py {nasty('py')}"),
    }
    done = slurm_cli("submit", values["config"], "--nodes", "2", "--gpus-per-node", "4", "--partition", "gpu",
                     "--time", "1:00:00", "--job-name", values["job_name"], "--out-root", values["out_root"],
                     "--set", values["set"], "--set", values["set2"], "--env", f"MY_VALUE={values['env']}",
                     "--container", values["container"], "--python", values["python"], "--no-check", "--dry-run",
                     cwd=work)
    assert done.returncode == 0, done.stderr
    return done.stdout, values


def no_pwned(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("pwned*"))


def test_strings_are_quoted_and_never_executed(tmp_path, fakes):
    work = tmp_path / "work"
    work.mkdir()
    text, values = render(tmp_path, work)
    script = work / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0

    out_dir = Path(values["out_root"]) / values["job_name"]
    env = {"PATH": f"{fakes}:{os.environ['PATH']}", "HOME": str(tmp_path), "FAKE_LOG": str(tmp_path),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[007-008]", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_CPUS_PER_TASK": "32"}
    run = subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "training completed" in run.stdout
    assert no_pwned(tmp_path) == [], "a quoted string was executed"

    srun = json.loads((tmp_path / "srun.json").read_text())
    argv = srun["argv"]
    image = [a for a in argv if a.startswith("--container-image=")]
    assert image == [f"--container-image={values['container']}"]
    agent = argv.index("slurm.agent")
    assert argv[agent - 2] == values["python"]
    train = argv[argv.index("megaloop", agent) - 1:]
    assert train == ["-m", "megaloop", "train", values["config"], "--set", values["set"], "--set", values["set2"],
                     "--set", f"train.out_dir={out_dir}"]
    assert "--rdzv-endpoint=node007:24242" in argv and "--nproc-per-node=4" in argv
    assert srun["env"]["MY_VALUE"] == values["env"]
    deadline = int(subprocess.run(["date", "-d", "2030-01-02T03:04:05", "+%s"], capture_output=True,
                                  text=True).stdout)
    assert srun["env"]["MEGALOOP_DEADLINE"] == str(deadline - 60)
    assert srun["env"]["MASTER_ADDR"] == "node007" and srun["env"]["NCCL_DEBUG"] == "WARN"


def test_submit_writes_the_quoted_script_and_sbatch_gets_its_path(tmp_path, fakes):
    work = tmp_path / "work"
    work.mkdir()
    (fakes / "sbatch").write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$FAKE_LOG/sbatch.args"\necho 777\n')
    (fakes / "sbatch").chmod(stat.S_IRWXU)
    name, root = nasty("name"), str(work / f"out {nasty('root')}")
    env = dict(os.environ, PATH=f"{fakes}:{os.environ['PATH']}", FAKE_LOG=str(tmp_path))
    done = slurm_cli("submit", str(TINY), "--nodes", "1", "--gpus-per-node", "8", "--partition", "gpu", "--time",
                     "1:00:00", "--job-name", name, "--out-root", root, "--no-check", cwd=work, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "777"
    args = (tmp_path / "sbatch.args").read_text().splitlines()
    assert args[0] == "--parsable" and Path(args[1]).parent == Path(root) / name / "slurm"
    escaped = name.replace('"', '\\"')
    assert f'#SBATCH --job-name="{escaped}"' in Path(args[1]).read_text()
    assert no_pwned(tmp_path) == []


@pytest.mark.slurm
def test_sbatch_reads_quoted_header_back(tmp_path, cluster):
    """The real sbatch parses the `#SBATCH` lines: the job keeps the exact name, and Slurm writes its output into the
    exact folder (the job runs /bin/false in place of python: it fails at once and trains nothing)."""
    work = tmp_path / "work"
    work.mkdir()
    name, root = nasty("name"), work / f"out {nasty('root')} 100%"
    done = slurm_cli("submit", str(TINY), "--nodes", "1", "--procs-per-node", "1", "--partition", "debug",
                     "--time", "10", "--job-name", name, "--out-root", str(root), "--no-check", "--python",
                     "/bin/false", cwd=work)
    assert done.returncode == 0, done.stderr
    job = done.stdout.split()[-1]
    wait_gone(job, 120)
    raw = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    assert f"JobName={name}\n" in raw, raw
    assert job_state(job)["JobState"] == "FAILED"
    log = root / name / "slurm" / f"{job}.out"
    assert log.is_file() and "training failed" in log.read_text()
    assert no_pwned(tmp_path) == []
