"""Bad input to `python -m megaloop train` fails with a clear message (exit 2) before any heavy work: no output
directory is created and no model is built."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _train(*args, cwd):
    return subprocess.run([sys.executable, "-m", "megaloop", "train", str(REPO / "configs" / "parcae-tiny.yaml"),
                           *args], capture_output=True, text=True, cwd=REPO, timeout=120)


@pytest.mark.parametrize("overrides,expected", [
    (["train.stesp=5"], "train.stesp=5: unknown key (did you mean 'steps'?)"),
    (["train.steps=five"], "train.steps='five': must be an integer"),
    (["data.global_batch_size=12"], "data.global_batch_size=12: must be divisible by data.micro_batch_size x dp"),
    (["data.shards=/nonexistent/shards"], "data.shards='/nonexistent/shards': is not a shard directory"),
    ([], "data.shards=None: set it to a directory written by `python -m data_prep shards`"),
])
def test_bad_input_is_named_before_work(overrides, expected, tmp_path):
    out = tmp_path / "out"
    args = [a for o in overrides + [f"train.out_dir={out}"] for a in ("--set", o)]
    proc = _train(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists(), "nothing may be written for a bad config"


def test_help_lists_commands():
    proc = subprocess.run([sys.executable, "-m", "megaloop", "train", "--help"], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 0 and "--set KEY=VALUE" in proc.stdout


def _megaloop(*args, env=None):
    import os

    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS")}
    return subprocess.run([sys.executable, "-m", "megaloop", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=120, env={**clean, **(env or {})})


def _one_line_error(proc, *expected):
    """rc 2, no traceback, exactly one stderr line that names the input and says what is wrong and what to do."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megaloop: "), proc.stderr
    for text in expected:
        assert text in lines[0], lines[0]


TINY = REPO / "configs" / "parcae-tiny.yaml"


@pytest.mark.parametrize("override,expected", [
    ("optim.matrix_lr=-1", "config error: optim.matrix_lr=-1.0: allowed values are a finite number > 0 (the default"),
    ("optim.adam_lr=.nan", "config error: optim.adam_lr=nan: allowed values are a finite number > 0"),
    ("optim.betas=[0.9, 1.5]", "config error: optim.betas=(0.9, 1.5): allowed values are two numbers in [0, 1)"),
    ("optim.grad_clip=-1", "config error: optim.grad_clip=-1.0: allowed values are a finite number >= 0"),
    ("train.steps=[1", "config error: --set='train.steps=[1': the value is not valid YAML (line 1, column 3"),
])
def test_bad_values_are_one_line_config_errors(override, expected, tmp_path):
    for command in ("check", "train"):
        _one_line_error(_megaloop(command, TINY, "--set", override, "--set", f"train.out_dir={tmp_path}/out"),
                        expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content,expected", [
    ("model:\n  d_model: [1\n", "bad.yaml: line 3, column 1: malformed YAML (while parsing a flow sequence that "
                                "starts at line 2, column 12"),
    ("model:\n  d_model: 1\n   x: 2\n", "bad.yaml: line 3, column 5: malformed YAML (mapping values are not allowed"),
    ("", "bad.yaml: holds no settings (empty or only comments); a config is a YAML mapping of the sections"),
    ("# nothing but a comment\n", "bad.yaml: holds no settings"),
])
def test_config_files_that_are_not_configs(content, expected, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    for command in ("check", "train"):
        _one_line_error(_megaloop(command, path), "config error: ", expected)


def test_a_config_path_that_is_a_directory(tmp_path):
    _one_line_error(_megaloop("train", tmp_path), f"config error: {tmp_path}: is a directory, not a config file")


def test_data_parallel_in_one_plain_process_is_refused(tmp_path):
    _one_line_error(_megaloop("train", TINY, "--set", "parallel.dp=2", "--set", f"train.out_dir={tmp_path}/o"),
                    "tp x pp x dp = 2 but the job has 1 processes; this is a single process",
                    "torchrun --standalone --nproc-per-node 2 -m megaloop train")
    _one_line_error(_megaloop("check", TINY, env={"WORLD_SIZE": "two"}), "$WORLD_SIZE='two'", "must be an integer")


def test_data_parallel_in_one_process_is_refused_by_the_runtime_too(tmp_path):
    import torch

    from megaloop.config import ConfigError, load_config
    from megaloop.train.runtime import make_runtime

    cfg = load_config(TINY, ["parallel.dp=2"])            # no world size given: the library path
    with pytest.raises(ConfigError, match="parallel.dp=2: this is a single process"):
        make_runtime(cfg, torch.device("cpu"))


def test_cuda_without_a_gpu_is_a_config_error(tiny_shards, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    _one_line_error(_megaloop("train", TINY, "--set", "train.device=cuda", *_tiny_sets(tiny_shards, tmp_path)),
                    "config error: train.device='cuda': no CUDA device is available", "train.device=cpu")
    assert not (tmp_path / "out").exists()


def _tiny_sets(shards, tmp_path) -> list[str]:
    from tests.train.conftest import fast_overrides

    return [a for o in fast_overrides(shards, tmp_path / "out") for a in ("--set", o)]


def test_an_out_dir_that_is_a_file(tiny_shards, tmp_path):
    (tmp_path / "out").write_text("a file")
    _one_line_error(_megaloop("train", TINY, *_tiny_sets(tiny_shards, tmp_path)),
                    f"config error: train.out_dir='{tmp_path}/out': is a file, not a directory")


@pytest.mark.parametrize("edit,expected", [
    (lambda text: text[: len(text) // 2], "manifest.json is not valid JSON"),
    (lambda text: text.replace('"seq_len": 32', '"seq_len": 64'),
     "manifest.json records seq_len=64 but rows of 33 tokens (a row holds seq_len + 1): the manifest contradicts"),
])
def test_a_broken_manifest_at_train_time(edit, expected, tiny_shards, tmp_path):
    import json
    import shutil

    shards = tmp_path / "shards"
    shutil.copytree(tiny_shards, shards)
    text = json.dumps(json.loads((shards / "manifest.json").read_text()))
    (shards / "manifest.json").write_text(edit(text))
    sets = _tiny_sets(shards, tmp_path)
    if "64" in expected:
        sets = [s.replace("model.seq_len=32", "model.seq_len=64") for s in sets]
    _one_line_error(_megaloop("train", TINY, *sets), "config error: data.shards=", expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("nproc,sets,expected", [
    (3, ["parallel.tp=2"], "the job's 3 processes are not a multiple of tp x pp = 2 x 1"),
    (2, ["train.stesp=5"], "train.stesp=5: unknown key"),
    (0, [], "--nproc-per-node=0: must be >= 1"),
])
def test_launch_checks_the_config_before_any_process_starts(nproc, sets, expected, tmp_path):
    out = tmp_path / "out"
    args = [a for o in sets + [f"train.out_dir={out}"] for a in ("--set", o)]
    proc = subprocess.run([sys.executable, "-m", "megaloop", "launch", "--nproc-per-node", str(nproc),
                           str(REPO / "configs" / "parcae-tiny.yaml"), *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
