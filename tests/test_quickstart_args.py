"""scripts/quickstart.sh with bad input: one line, exit status 2, before any training (and, for malformed
arguments, before the setup); shards made from another corpus than CORPUS are not silently reused."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _quickstart(*args, **env):
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OUT", "CORPUS", "NPROC")}
    return subprocess.run(["bash", str(REPO / "scripts" / "quickstart.sh"), *args], capture_output=True, text=True,
                          cwd=REPO, env={**clean, **env}, timeout=600)


def _one_line_error(done, *expected):
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for text in expected:
        assert text in lines[0], lines[0]


@pytest.mark.parametrize("args,env,expected", [
    (["--steps", "5"], {}, "quickstart: unknown option --steps; arguments are config overrides section.key=value"),
    (["train.steps"], {}, "quickstart: argument 'train.steps' is not a config override; write section.key=value"),
    ([], {"NPROC": "two"}, "quickstart: NPROC=two is not a positive integer"),
    ([], {"CORPUS": "/nonexistent/corpus"}, "quickstart: CORPUS=/nonexistent/corpus is not a directory"),
])
def test_malformed_arguments_stop_before_the_setup(args, env, expected, tmp_path):
    done = _quickstart(*args, OUT=str(tmp_path / "out"), **env)
    _one_line_error(done, expected)
    assert "[setup]" not in done.stdout and not (tmp_path / "out").exists()


def test_help():
    done = _quickstart("--help")
    assert done.returncode == 0 and "usage:" in done.stdout and "train.steps=50" in done.stdout


@pytest.mark.slow
def test_bad_overrides_and_another_corpus_are_refused_before_training(tmp_path):
    from data_prep.prepare import ShardOptions, prepare_shards
    from data_prep.tokenizer import train_tokenizer

    sample = REPO / "data" / "sample_corpus"
    first, other = tmp_path / "first", tmp_path / "other"
    for corpus, name in ((first, "Doyle_Lost_1912.txt"), (other, "Kipling_Light_1891.txt")):
        corpus.mkdir()
        shutil.copy(sample / name, corpus / name)
    shutil.copy(sample / "Stevenson_Arrow_1888.txt", first)   # two documents: one for validation
    out = tmp_path / "out"
    train_tokenizer(first, out / "tokenizer", vocab_size=300, progress=False)
    prepare_shards(first, out / "tokenizer", out / "shards", ShardOptions(seq_len=128, progress=False))

    _one_line_error(_quickstart("train.steps=abc", OUT=str(out), CORPUS=str(first)),
                    "megaloop: config error: train.steps='abc': must be an integer")
    done = _quickstart("train.steps=2", OUT=str(out), CORPUS=str(other))
    _one_line_error(done, f"quickstart: the shards in {out}/shards do not fit CORPUS={other}",
                    "made from another corpus", "pass OUT=another directory")
    assert not (out / "train").exists(), "nothing may be trained on shards of another corpus"
