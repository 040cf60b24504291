"""The command line contract: spellings, --help, an end-to-end run, exit codes; and the import rule."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, check_rc: int | None = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-m", "data_prep", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=300)
    if check_rc is not None:
        assert done.returncode == check_rc, done.stdout + done.stderr
    return done


@pytest.mark.parametrize("command, spellings", [
    ([], ["tokenizer", "shards", "inspect"]),
    (["tokenizer"], ["--input", "--output", "--vocab-size"]),
    (["shards"], ["--input", "--tokenizer", "--output", "--seq-len", "--workers", "--val-fraction",
                  "--shard-size", "--keep-last-partial"]),
    (["inspect"], ["shard_dir", "--verify"]),
])
def test_help_lists_the_contract_spellings(command, spellings):
    out = _cli(*command, "--help").stdout
    for spelling in spellings:
        assert spelling in out


def test_end_to_end_tokenizer_shards_inspect(small_corpus, tmp_path):
    tok, shards = tmp_path / "tok", tmp_path / "shards"
    out = _cli("tokenizer", "--input", str(small_corpus), "--output", str(tok), "--vocab-size", "512").stdout
    assert "vocab 512" in out and "hash " in out and "bytes per token" in out
    out = _cli("shards", "--input", str(small_corpus), "--tokenizer", str(tok), "--output", str(shards),
               "--seq-len", "128", "--workers", "2", "--val-fraction", "0.1", "--shard-size", "5").stdout
    assert "MB/s" in out and "train:" in out and "val:" in out
    report = _cli("inspect", str(shards)).stdout
    assert "checksums (full):" in report and "hash matches the manifest" in report and "<|bos|>" in report
    assert report.rstrip().endswith("OK")
    victim = sorted(shards.glob("train-*.tar"))[1]
    victim.write_bytes(victim.read_bytes()[:-20000])
    report = _cli("inspect", str(shards), "--verify", "fast", check_rc=1).stdout
    assert f"BAD {victim.name}: truncated" in report


def test_errors_exit_2_with_what_to_do(tmp_path):
    (tmp_path / "empty").mkdir()
    done = _cli("shards", "--input", str(tmp_path / "empty"), "--tokenizer", str(tmp_path), "--output",
                str(tmp_path / "o"), "--seq-len", "8", check_rc=2)
    assert done.stderr.startswith("error: ") and "What to do" in done.stderr
    assert "Traceback" not in done.stderr


def test_data_prep_never_imports_megaloop():
    for path in sorted((REPO / "data_prep").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            assert not any(n == "megaloop" or n.startswith("megaloop.") for n in names), path
    code = ("import sys, data_prep.cli, data_prep.prepare, data_prep.mpi_prepare, data_prep.loader, "
            "data_prep.inspect_cmd; assert not [m for m in sys.modules if m.startswith('megaloop')]")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_cli_does_not_import_torch_for_preparation():
    code = ("import sys, data_prep.cli, data_prep.prepare, data_prep.mpi_prepare, data_prep.inspect_cmd; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    assert shutil.which("tar"), "plain tar is needed by the shard tests"


def test_tokenizer_prints_no_blank_lines_into_a_pipe(small_corpus, tmp_path):
    done = _cli("tokenizer", "--input", str(small_corpus), "--output", str(tmp_path / "tok"), "--vocab-size", "512")
    assert done.stdout.startswith("trained in") and "\n\n" not in done.stdout, repr(done.stdout)
