"""Rendering without a cluster: the sbatch header, one-line refusals (exit 2) of values Slurm would reject, the
isoFLOP table (steps from megaloop's FLOP model), segments chained with afterany, and the README's 16 x 8 snapshot."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurm import options
from slurm.options import OptionError
from tests.slurm.jobs import REPO, TINY, slurm_cli

BASE = ["--nodes", "2", "--gpus-per-node", "8", "--partition", "gpu", "--time", "4:00:00"]


def dry(*args: str) -> str:
    done = slurm_cli("submit", *args, "--dry-run")
    assert done.returncode == 0, done.stderr
    return done.stdout


def sbatch_options(text: str) -> dict[str, str | None]:
    found = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH --"):
            key, eq, value = line[len("#SBATCH --"):].partition("=")
            found[key] = value if eq else None
    return found


def test_gpu_job_header_and_launch():
    text = dry("configs/parcae-1_3b.yaml", *BASE, "--account", "proj-1", "--job-name", "p13", "--signal-lead", "600")
    opts = sbatch_options(text)
    assert opts["nodes"] == "2" and opts["ntasks-per-node"] == "1" and opts["gpus-per-node"] == "8"
    assert opts["cpus-per-task"] == "64" and "exclusive" in opts and opts["mem"] == "0"
    assert opts["signal"] == "B:USR1@600" and "requeue" in opts and opts["open-mode"] == "append"
    assert opts["time"] == "4:00:00" and opts["account"] == '"proj-1"' and opts["job-name"] == '"p13"'
    assert opts["output"] == '"runs/p13/slurm/%j.out"'
    assert "--rdzv-backend=c10d" in text and '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"' in text
    assert '--nproc-per-node="$NPROC_PER_NODE"' in text and "NPROC_PER_NODE=8" in text
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}" in text
    assert "TRAIN=(-m megaloop train configs/parcae-1_3b.yaml)" in text and "OUT_DIR=runs/p13" in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_cpu_job_has_no_gpu_options():
    opts = sbatch_options(dry(str(TINY), "--nodes", "1", "--procs-per-node", "4", "--partition", "debug",
                              "--time", "30"))
    assert "gpus-per-node" not in opts and "exclusive" not in opts and opts["cpus-per-task"] == "4"


def test_out_dir_from_set_and_container():
    text = dry(str(TINY), *BASE, "--set", "train.out_dir=/scratch/r1", "--container", "nvcr.io#nvidia/pytorch:25.01")
    assert "OUT_DIR=/scratch/r1" in text and '#SBATCH --output="/scratch/r1/slurm/%j.out"' in text
    assert "--container-image='nvcr.io#nvidia/pytorch:25.01'" in text and "PYTHON=python" in text


def test_percent_in_paths_is_not_a_slurm_pattern():
    text = dry(str(TINY), *BASE, "--out-root", "/data/100%", "--job-name", "r%j")
    assert '#SBATCH --output="/data/100%%/r%%j/slurm/%j.out"' in text


@pytest.mark.parametrize("args,needle", [
    (["--time", "2 days"], "--time '2 days': not a Slurm time limit"),
    (["--time", "0"], "must be a positive limit"),
    (["--time", "5"], "leaves less than 120 s of training"),
    (["--partition", "gpu;rm"], "--partition 'gpu;rm': must be comma-separated names"),
    (["--account", "a b"], "--account 'a b': must be a name"),
    (["--job-name", "a/b"], "no '/'"),
    (["--set", "train.steps"], "must be section.key=value"),
    (["--env", "1X=2"], "NAME=VALUE"),
    (["--dependency", "afterany:$(id)"], "not a Slurm dependency"),
    (["--nodes", "0"], "--nodes 0: must be >= 1"),
    (["--out-root", "a\\b"], "backslash"),
    (["--job-name", "two\nlines"], "control characters"),
])
def test_bad_values_are_refused_in_one_line(args, needle):
    argv = ["submit", str(TINY), "--nodes", "1", "--gpus-per-node", "8", "--partition", "gpu", "--time", "1:00:00",
            *args, "--dry-run"]
    done = slurm_cli(*argv)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and needle in done.stderr, done.stderr


def test_missing_config_and_help():
    done = slurm_cli("submit", "configs/nope.yaml", *BASE, "--dry-run")
    assert done.returncode == 2 and "no such file" in done.stderr
    for sub in ([], ["submit"], ["sweep"]):
        helped = slurm_cli(*sub, "--help")
        assert helped.returncode == 0 and "usage" in helped.stdout
    agent = subprocess.run([sys.executable, "-m", "slurm.agent", "--help"], cwd=REPO, capture_output=True, text=True)
    assert agent.returncode == 0 and "left to the workers" in agent.stdout


def test_agent_tells_an_agreed_stop_from_a_failure():
    from slurm.agent import agreed_stop

    assert agreed_stop([75]) and agreed_stop([-15, 75])
    assert not agreed_stop([-15]) and not agreed_stop([-9, 75]) and not agreed_stop([1, 75]) and not agreed_stop([1])


@pytest.mark.parametrize("value,seconds", [("30", 1800), ("30:15", 1815), ("4:00:00", 14400), ("2-00", 172800),
                                           ("1-02:03", 93780), ("1-02:03:04", 93784)])
def test_time_formats(value, seconds):
    assert options.time_seconds(value) == seconds


def test_dependencies():
    for ok in ("afterany:12", "afterok:12:13,afternotok:14", "singleton", "afterany:12_3", "after:5+10"):
        assert options.dependency(ok) == ok
    with pytest.raises(OptionError):
        options.dependency("afterany:12;touch x")


def sweep_dry(*extra: str, shards: Path) -> subprocess.CompletedProcess:
    sets = [f"data.shards={shards}", "model.vocab_size=512", "model.seq_len=32", "data.global_batch_size=8",
            "data.micro_batch_size=4"]
    return slurm_cli("sweep", str(TINY), "--nodes", "1", "--procs-per-node", "2", "--partition", "debug",
                     "--time", "10", *[a for s in sets for a in ("--set", s)], *extra, "--dry-run")


@pytest.mark.parametrize("mu_bwd", ["half", "config", "1"])
def test_sweep_table_uses_megaloop_flop_model(tiny_shards, mu_bwd):
    from megaloop.config import load_config
    from megaloop.train.flops import FlopModel

    done = sweep_dry("--mu-rec", "2,4,8", "--flops", "1e11,3e11", "--array-parallel", "2", "--mu-bwd", mu_bwd,
                     shards=tiny_shards)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "#SBATCH --array=0-5%2" in text
    rows = re.findall(r"^#\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\d+)\s+(\S+)$", text, re.M)
    assert len(rows) == 6
    fixed = {"half": ["model.mu_bwd=null"], "config": [], "1": ["model.mu_bwd=1"]}[mu_bwd]
    for index, mu, k, budget, _, _, steps, out_dir in rows:
        cfg = load_config(TINY, [f"data.shards={tiny_shards}", "model.vocab_size=512", "model.seq_len=32",
                                 "data.global_batch_size=8", "data.micro_batch_size=4", f"model.mu_rec={mu}",
                                 *fixed])
        assert int(k) == cfg.model.backprop_depth == {"half": -(-int(mu) // 2), "config": 2, "1": 1}[mu_bwd]
        per_token = FlopModel.of(cfg.model).per_token(int(mu) - int(k), int(k))
        tokens = float(budget) / per_token
        assert int(steps) == round(tokens / (8 * 32))
        assert abs(int(steps) * 8 * 32 - tokens) <= 8 * 32 / 2
        point = " ".join(f"--set {o}" for o in [f"model.mu_rec={mu}", *fixed, f"train.steps={steps}"])
        assert f"  {index}) OUT_DIR={out_dir}; POINT=({point}) ;;" in text
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_sweep_refusals(tiny_shards):
    taken = sweep_dry("--mu-rec", "2,4", "--flops", "1e11", "--set", "train.steps=5", shards=tiny_shards)
    assert taken.returncode == 2 and "is set by the sweep" in taken.stderr
    tiny = sweep_dry("--mu-rec", "2", "--flops", "1e3", shards=tiny_shards)
    assert tiny.returncode == 2 and "less than one step" in tiny.stderr
    low = sweep_dry("--mu-rec", "1,2", "--flops", "1e11", "--mu-bwd", "config", shards=tiny_shards)
    assert low.returncode == 2 and "model.mu_bwd=2: must be in [1, model.mu_rec=1]" in low.stderr, low.stderr
    bad = sweep_dry("--mu-rec", "2,x", "--flops", "1e11", shards=tiny_shards)
    assert bad.returncode == 2 and "comma-separated integers" in bad.stderr
    wrong = sweep_dry("--mu-rec", "2", "--flops", "1e11", "--set", "model.nope=3", shards=tiny_shards)
    assert wrong.returncode == 2 and "could not compute FLOPs per token" in wrong.stderr
    assert len(wrong.stderr.strip().splitlines()) == 1


def readme_snapshot() -> tuple[list[str], str]:
    """The 16 x 8 dry-run command of slurm/README.md and the script printed under it."""
    text = (REPO / "slurm" / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    for i, block in enumerate(blocks):
        if block.startswith("python -m slurm submit") and "--nodes 16 --gpus-per-node 8" in block and \
                "--dry-run" in block:
            return block.split()[3:], blocks[i + 1]
    raise AssertionError("slurm/README.md has no 16 x 8 dry-run block")


def test_readme_snapshot_is_what_dry_run_prints():
    argv, expected = readme_snapshot()
    assert argv[0] == "submit" and not any("\\" in a for a in argv)
    done = slurm_cli(*argv)
    assert done.returncode == 0, done.stderr
    printed = done.stdout
    venv_python = REPO / ".venv" / "bin" / "python"
    if Path(sys.executable) != venv_python:  # the default --python is the interpreter that renders the script
        printed = re.sub(r"^PYTHON=.*$", "PYTHON=.venv/bin/python", printed, flags=re.M)
    assert printed == expected


def test_segments_are_chained_with_afterany(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text("#!/bin/bash\nn=$(( $(cat \"$0.n\" 2>/dev/null || echo 100) + 1 ))\n"
                                 "echo $n > \"$0.n\"\necho \"$*\" >> \"$0.log\"\necho \"$n;cluster\"\n")
    (fake / "sbatch").chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "HOME": str(tmp_path)}
    done = slurm_cli("submit", str(TINY), *BASE, "--out-root", str(tmp_path / "runs"), "--segments", "3",
                     "--dependency", "afterok:7", "--no-check", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["101", "102", "103"]
    calls = (fake / "sbatch.log").read_text().splitlines()
    assert calls[0].startswith("--parsable /") and "--dependency=afterany:101" in calls[1]
    assert "--dependency=afterany:102" in calls[2]
    script = Path(calls[0].split()[-1]).read_text()
    assert "REQUEUE=0" in script and "#SBATCH --dependency=afterok:7" in script
    assert script.startswith("#!/bin/bash")


def test_a_failed_sbatch_leaves_no_script_behind(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text("#!/bin/bash\necho 'sbatch: error: invalid partition specified: gpu' >&2\nexit 1\n")
    (fake / "sbatch").chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "HOME": str(tmp_path)}
    done = slurm_cli("submit", str(TINY), *BASE, "--out-root", str(tmp_path / "runs"), "--no-check", env=env)
    assert done.returncode == 1 and "invalid partition specified" in done.stderr, done.stderr
    assert not list(tmp_path.rglob("*.sbatch")) and not (tmp_path / "runs").exists()


def _nccl_env(tmp_path, **preset) -> dict[str, str]:
    """Run the rendered NCCL block in bash with OUT_DIR set and print the flight recorder's variables."""
    from slurm import body
    script = f"OUT_DIR={tmp_path}\n{body.NCCL}\n" + "".join(
        f'echo {k}="${{{k}}}"\n' for k in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                                          "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "PYTORCH_CUDA_ALLOC_CONF"))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCH_NCCL") and k != "PYTORCH_CUDA_ALLOC_CONF"} | preset
    out = subprocess.run(["bash", "-c", script], env=env, text=True, capture_output=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


def test_nccl_flight_recorder_dumps_into_the_run_and_keeps_user_values(tmp_path):
    got = _nccl_env(tmp_path)
    assert got["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000" and got["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert got["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == f"{tmp_path}/nccl_trace/rank_"
    assert (tmp_path / "nccl_trace").is_dir()
    mine = _nccl_env(tmp_path / "b", TORCH_NCCL_TRACE_BUFFER_SIZE="7", TORCH_NCCL_DEBUG_INFO_TEMP_FILE="/x/t_")
    assert mine["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "7" and mine["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/x/t_"
    assert not (tmp_path / "b").exists()


def test_the_cuda_allocator_gets_expandable_segments_unless_the_user_set_it(tmp_path):
    assert _nccl_env(tmp_path)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    mine = _nccl_env(tmp_path, PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:512")
    assert mine["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
