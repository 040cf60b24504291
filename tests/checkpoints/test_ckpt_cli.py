"""`python -m checkpoints inspect|verify`: output, --json, exit codes (0 fine, 1 corrupt, 2 bad input), one-line
errors without a traceback, and no BrokenPipeError when piped into `head`."""
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import fast_write

from checkpoints import Checkpointer, Piece

REPO = Path(__file__).resolve().parents[2]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "checkpoints", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Two checkpoints; step 2 has many arrays (output larger than a pipe buffer)."""
    root = tmp_path_factory.mktemp("cli")
    with Checkpointer(root, async_save=False, file_writer=fast_write) as c:
        c.save(1, [Piece("model/w", (4, 2), (0, 0), torch.ones(4, 2))], {"tokens": 10})
        many = [Piece(f"model/layers.{i}.mlp.experts.weight_with_a_long_name", (2,), (0,), torch.zeros(2))
                for i in range(1200)]
        c.save(2, [Piece("model/w", (4, 2), (0, 0), torch.ones(4, 2).bfloat16())] + many,
               {"tokens": 4096, "layout": {"tp": 2, "pp": 1, "dp": 4}})
    return root


def test_inspect_shows_step_tokens_layout_and_arrays(root):
    out = cli("inspect", root)                                   # a root: the checkpoint `latest` names
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].split() == ["step", "2"] and lines[2].split() == ["tokens", "4096"]
    assert '"tp": 2' in out.stdout and "schema_version  1" in out.stdout
    assert any(line.split()[:4] == ["model/w", "4x2", "bfloat16", "4x2"] and line.endswith("16") for line in lines)
    data = json.loads(cli("inspect", "--json", root / "step_00000001").stdout)
    assert data["step"] == 1 and data["tokens"] == 10 and data["layout"] is None
    assert data["arrays"]["model/w"] == {"shape": [4, 2], "dtype": "float32", "chunks": [4, 2], "bytes": 32}


def test_inspect_piped_into_head_exits_quietly(root):
    cmd = f"{shlex.quote(sys.executable)} -m checkpoints inspect {shlex.quote(str(root))} | head -n 2"
    out = subprocess.run(cmd, shell=True, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert len(out.stdout.splitlines()) == 2
    assert "Traceback" not in out.stderr, out.stderr
    assert "brokenpipe" not in out.stderr.lower().replace(" ", ""), out.stderr


def test_verify_ok_then_corrupt(root, tmp_path):
    out = cli("verify", root / "step_00000001")
    assert out.returncode == 0 and out.stdout.startswith("OK ") and "1 arrays" in out.stdout, out
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(root), str(copy)], check=True)
    chunk = copy / "step_00000001" / "model/w/c/0/0"
    chunk.write_bytes(chunk.read_bytes()[:-1])
    out = cli("verify", copy / "step_00000001")
    assert out.returncode == 1 and "CORRUPT" in out.stdout and "array 'model/w'" in out.stdout, out
    out = cli("verify", "--all", copy)
    assert out.returncode == 1 and out.stdout.count("OK ") == 1 and out.stdout.count("CORRUPT ") == 1, out


@pytest.mark.parametrize("make, command", [("missing", "inspect"), ("empty", "verify"), ("pickle", "inspect")])
def test_bad_input_is_one_line_and_exit_2(tmp_path, make, command):
    target = tmp_path / "ckpt"
    if make != "missing":
        target.mkdir()
    if make == "pickle":
        (target / "metadata.json").write_bytes(b"\x80\x04\x95junk")
        (target / "COMMIT").write_text("{}")
    out = cli(command, target)
    assert out.returncode == 2, out
    assert out.stderr.startswith("checkpoints: ") and out.stderr.count("\n") == 1, out.stderr
    assert "; " in out.stderr and "Traceback" not in out.stderr


def test_verify_of_a_damaged_metadata_file_says_corrupt(tmp_path):
    (tmp_path / "metadata.json").write_bytes(b"\x80\x04\x95junk")
    (tmp_path / "COMMIT").write_text("{}")
    out = cli("verify", tmp_path)
    assert out.returncode == 1 and "CORRUPT" in out.stdout and "not JSON" in out.stdout, out


def test_every_subcommand_has_help(capsys):
    from checkpoints.cli import main
    for argv in (["inspect", "--help"], ["verify", "--help"], ["--help"]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 0 and "usage:" in capsys.readouterr().out
