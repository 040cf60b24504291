"""`data_prep shards` over work units, end to end: one corpus as a text directory, FineWeb-Edu-style parquet (several
row groups), .jsonl.gz and .jsonl.zst gives byte-identical shards (pre-tokenized parquet the same rows); 1 worker,
4 workers, 3 separate --task invocations plus finalize, and mpirun -n 2 give byte-identical outputs; a prep killed
with SIGKILL at several points and re-run gives the straight run's bytes without redoing committed units; the
trainer reads parquet-made shards exactly as text-made ones."""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from data_prep.cli import main
from data_prep.text_io import normalise_text
from data_prep.unit_store import prep_dir

from dp_testing import SEQ_LEN

REPO = Path(__file__).resolve().parents[2]
MPIRUN = shutil.which("mpirun")


def _texts(corpus: Path) -> list[tuple[str, str]]:
    """(file name, the text a text-directory prep reads from it) of every file, by name."""
    return [(p.name, normalise_text(p.read_bytes())[0]) for p in sorted(corpus.iterdir()) if p.is_file()]


def _fineweb_rows(docs: list[tuple[str, str]]) -> list[dict]:
    """FineWeb-Edu's columns and types, the document's file name as its id."""
    return [{"text": text, "id": name, "dump": "CC-MAIN-2024-10", "url": f"https://example.org/{name}",
             "date": "2024-02-21T00:00:00Z", "file_path": f"s3://commoncrawl/{name}.warc.gz", "language": "en",
             "language_score": 0.97, "token_count": len(text) // 4, "score": 2.5 + (i % 3) * 0.5,
             "int_score": 2 + i % 3} for i, (name, text) in enumerate(docs)]


@pytest.fixture(scope="module")
def formats(small_corpus, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("formats")
    docs = _texts(small_corpus)
    (root / "text").mkdir()
    for name, text in docs:
        (root / "text" / name).write_text(text, encoding="utf-8")
    rows = _fineweb_rows(docs)
    (root / "parquet").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), root / "parquet" / "000_00000.parquet", row_group_size=4)
    lines = "".join(json.dumps(r) + "\n" for r in rows).encode()
    for kind, data in (("gz", gzip.compress(lines)), ("zst", zstandard.ZstdCompressor().compress(lines))):
        (root / kind).mkdir()
        (root / kind / f"docs.jsonl.{kind}").write_bytes(data)
    return {name: root / name for name in ("text", "parquet", "gz", "zst")}


def _shards(inputs, tok, out, *extra, expect: int = 0) -> None:
    argv = ["shards", "--input", *map(str, inputs if isinstance(inputs, list) else [inputs]), "--tokenizer",
            str(tok.directory), "--output", str(out), "--seq-len", str(SEQ_LEN), "--shard-size", "300",
            "--val-fraction", "0.1", "--quiet", *extra]
    assert main(argv) == expect


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _shard_bytes(directory: Path) -> dict[str, bytes]:
    return {k: v for k, v in _files(directory).items() if k.endswith(".tar")}


def _comparable(manifest_path: Path) -> dict:
    """The manifest without what records the inputs themselves (their names, sizes, checksums, file counts, bytes)
    and the options that name fields of a format."""
    m = json.loads(manifest_path.read_text())
    for key in ("inputs", "parameters"):
        m.pop(key)
    for key in ("files_listed", "files_used", "text_bytes"):
        m["counts"].pop(key)
    return m


def test_every_format_gives_the_same_shards(formats, chapters_tokenizer, tmp_path):
    outs = {}
    for name, inputs in formats.items():
        outs[name] = tmp_path / name
        extra = ["--engine", "units"] if name == "text" else ["--id-field", "id"]
        _shards(inputs, chapters_tokenizer, outs[name], *extra, "--shard-size", "8")  # best fit: a row a chapter
    ref = _shard_bytes(outs["text"])
    assert len(ref) >= 3 and json.loads((outs["text"] / "manifest.json").read_text())["format_version"] == 3
    for name, out in outs.items():
        assert _shard_bytes(out) == ref, name
        assert _comparable(out / "manifest.json") == _comparable(outs["text"] / "manifest.json"), name
    manifest = json.loads((outs["parquet"] / "manifest.json").read_text())
    # no document lost or duplicated: the counts add up to the corpus, token for token
    docs = _texts(formats["text"])
    splits = manifest["splits"]
    assert manifest["counts"]["documents_used"] == splits["train"]["documents"] + splits["val"]["documents"] \
        == len(docs) and manifest["counts"]["documents_skipped"] == 0
    assert sum(s["stream_tokens"] for s in splits.values()) == sum(len(chapters_tokenizer.encode(t)) + 2
                                                                   for _, t in docs)
    assert [i["name"] for i in manifest["inputs"]] == ["000_00000.parquet"]
    assert manifest["inputs"][0]["sha256"] == hashlib.sha256((formats["parquet"] / "000_00000.parquet").read_bytes()
                                                             ).hexdigest()
    # pre-tokenized parquet of the same ids: the same rows, without the tokenizer's encoding
    ids = pa.table({"id": [n for n, _ in docs],
                    "input_ids": pa.array([chapters_tokenizer.encode(t) for _, t in docs], pa.list_(pa.int32()))})
    (tmp_path / "tokenized").mkdir()
    pq.write_table(ids, tmp_path / "tokenized" / "t.parquet", row_group_size=5)
    _shards(tmp_path / "tokenized", chapters_tokenizer, tmp_path / "tok_out", "--tokens-field", "input_ids",
            "--id-field", "id", "--shard-size", "8")
    assert _shard_bytes(tmp_path / "tok_out") == ref


def _mpirun(ranks: int, args: list[str]) -> subprocess.CompletedProcess:
    from tests.process_group import run_group

    command = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", str(ranks), sys.executable, "-m", "data_prep",
               "shards", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return run_group(command, capture_output=True, text=True, timeout=180, cwd=REPO, env=env)


@pytest.mark.multiproc
def test_any_split_of_the_work_gives_the_same_bytes(formats, chapters_tokenizer, tmp_path, capsys):
    units = ["--engine", "units", "--unit-mb", "0.08"]  # ~10 units of the 0.8 MB corpus
    _shards(formats["text"], chapters_tokenizer, tmp_path / "one", *units, "--workers", "1")
    ref = _files(tmp_path / "one")
    planned = json.loads((tmp_path / "one" / "manifest.json").read_text())["counts"]["units"]
    assert planned >= 8
    _shards(formats["text"], chapters_tokenizer, tmp_path / "four", *units, "--workers", "4")
    assert _files(tmp_path / "four") == ref
    capsys.readouterr()
    for task in range(3):
        _shards(formats["text"], chapters_tokenizer, tmp_path / "tasks", *units, "--workers", "1",
                "--task", f"{task}/3")
        assert not (tmp_path / "tasks" / "manifest.json").exists()
    assert "data_prep finalize --output" in capsys.readouterr().out
    assert main(["finalize", "--output", str(tmp_path / "tasks")]) == 0
    assert _files(tmp_path / "tasks") == ref and not prep_dir(tmp_path / "tasks").exists()
    if MPIRUN is None or importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpirun or mpi4py not installed: the MPI split was not checked")
    done = _mpirun(2, ["--input", str(formats["text"]), "--tokenizer", str(chapters_tokenizer.directory), "--output",
                       str(tmp_path / "mpi"), "--seq-len", str(SEQ_LEN), "--shard-size", "300", "--val-fraction", "0.1",
                       "--quiet", *units])
    assert done.returncode == 0, done.stderr
    assert _files(tmp_path / "mpi") == ref


def _committed_units(out: Path) -> int:
    units = prep_dir(out) / "units"
    return sum(1 for d in units.iterdir() if (d / "unit.json").exists()) if units.is_dir() else 0


@pytest.mark.multiproc
def test_a_killed_prep_rerun_gives_the_straight_bytes_and_skips_committed_units(formats, chapters_tokenizer, tmp_path):
    args = ["--input", str(formats["text"]), "--tokenizer", str(chapters_tokenizer.directory), "--seq-len",
            str(SEQ_LEN), "--shard-size", "300", "--val-fraction", "0.1", "--quiet", "--engine", "units",
            "--unit-mb", "0.04", "--workers", "1"]
    _shards(formats["text"], chapters_tokenizer, tmp_path / "straight", "--engine", "units", "--unit-mb", "0.04",
            "--workers", "1")
    ref = _files(tmp_path / "straight")
    total = json.loads((tmp_path / "straight" / "manifest.json").read_text())["counts"]["units"]
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "data_prep", "shards", *args, "--output", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    kills = 0
    rng = random.Random(30)  # three random points: after a random number of committed units, plus a random delay
    for wait_for in sorted(rng.sample(range(1, total - 1), 3)):
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while proc.poll() is None and _committed_units(out) < wait_for and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.05))  # mid-unit, mostly: a unit takes ~0.05-0.1 s here
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.communicate(timeout=60)
        assert not (out / "manifest.json").exists()
    assert kills >= 2
    before = _committed_units(out)
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert f"{before} already committed (skipped), {total - before} to write" in done.stdout
    assert _files(out) == ref


def test_training_reads_parquet_shards_as_text_shards(formats, chapters_tokenizer, tmp_path):
    from megaloop.config import load_config
    from megaloop.train.loop import train

    losses = {}
    for name, extra in (("text", []), ("parquet", ["--id-field", "id"])):
        shards = tmp_path / f"shards_{name}"
        prep = "--engine stream" if name == "text" else ""
        _shards(formats[name], chapters_tokenizer, shards, *(prep.split() + extra))
        cfg = load_config(str(REPO / "configs" / "parcae-tiny.yaml"), [
            f"data.shards={shards}", f"train.out_dir={tmp_path / ('run_' + name)}", "train.steps=20",
            "model.vocab_size=4096", "model.d_model=64", "model.n_heads=2", f"model.seq_len={SEQ_LEN}",
            "data.micro_batch_size=4", "data.global_batch_size=8", "data.val_batches=1", "train.val_every=1000",
            "train.progress=false", "train.precision=fp32", "model.ve_gate_channels=16", "checkpoint.every=0"])
        losses[name] = train(cfg).losses
    assert len(losses["text"]) == 20 and losses["parquet"] == losses["text"]  # bitwise: the same floats


def test_remote_inputs_give_the_local_shards(formats, chapters_tokenizer, tmp_path):
    """https:// (JSON lines .zst) and s3:// (parquet) inputs, read through the loader's stores."""
    from data_prep.local_servers import FileServer, S3Server

    _shards(formats["text"], chapters_tokenizer, tmp_path / "local", "--engine", "units")
    ref = _shard_bytes(tmp_path / "local")
    http = FileServer(formats["zst"].parent)
    s3 = S3Server()
    try:
        _shards([f"{http.url}/zst/docs.jsonl.zst"], chapters_tokenizer, tmp_path / "https", "--id-field", "id")
        url = s3.put_dir(formats["parquet"], "corpora", "fineweb-edu")
        _shards([f"{url}/000_00000.parquet"], chapters_tokenizer, tmp_path / "s3", "--id-field", "id",
                "--s3-endpoint", s3.endpoint)
    finally:
        http.down()
        s3.close()
    assert _shard_bytes(tmp_path / "https") == ref and _shard_bytes(tmp_path / "s3") == ref
    manifest = json.loads((tmp_path / "s3" / "manifest.json").read_text())
    local = formats["parquet"] / "000_00000.parquet"
    assert manifest["inputs"] == [{"name": "000_00000.parquet", "size": local.stat().st_size,
                                   "sha256": hashlib.sha256(local.read_bytes()).hexdigest()}]


def test_output_is_uploaded_manifest_last(formats, chapters_tokenizer, tmp_path, capsys):
    _shards(formats["parquet"], chapters_tokenizer, tmp_path / "out", "--id-field", "id", "--out",
            str(tmp_path / "uploaded"))
    assert "manifest last" in capsys.readouterr().out
    assert _files(tmp_path / "uploaded") == _files(tmp_path / "out")
