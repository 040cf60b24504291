"""`data_prep tokenizer` over parquet / JSON lines: the sample is drawn across every input in the documented piece
order (not from the first files), is the same on every run, never trains on its held-out documents, and the
command reports bytes per token on those."""
from __future__ import annotations

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq

from data_prep.cli import main
from data_prep.readers import ReadOptions
from data_prep.tokenizer_sample import SALT, sample_documents

WORDS = "river stone lantern orchard velvet harbor meadow copper thistle ember".split()


def _doc(f: int, i: int) -> str:
    return f"file {f} doc {i}: " + " ".join(WORDS[(f * 7 + i * 3 + k) % len(WORDS)] for k in range(40 + i))


def _corpus(tmp_path, files: int = 8, per_file: int = 6):
    root = tmp_path / "jsonl"
    root.mkdir()
    for f in range(files):
        lines = "".join(json.dumps({"text": _doc(f, i)}) + "\n" for i in range(per_file))
        (root / f"part-{f:02d}.jsonl").write_text(lines)
    return root


def test_the_sample_follows_the_piece_order_across_all_files(tmp_path):
    root = _corpus(tmp_path)
    per_file = sum(len(_doc(0, i)) for i in range(6))  # about the same for every file
    sample = sample_documents([str(root)], ReadOptions(), max_chars=int(2.5 * per_file), held_out_chars=per_file,
                              progress=False)
    order = sorted(range(8), key=lambda f: hashlib.sha256(f"{SALT}part-{f:02d}.jsonl:0".encode()).hexdigest())
    taken = sorted({int(t.split()[1]) for t in sample.texts})
    assert taken == sorted(order[:3]) and taken != [0, 1, 2]  # whole pieces, in hash order: not the first files
    held = {int(t.split()[1]) for t in sample.held_out}
    assert held and not set(sample.texts) & set(sample.held_out) and held <= set(order[2:5])
    again = sample_documents([str(root)], ReadOptions(), max_chars=int(2.5 * per_file), held_out_chars=per_file,
                             progress=False)
    assert again.texts == sample.texts and again.held_out == sample.held_out


def test_tokenizer_on_parquet_reports_held_out_bytes_per_token(tmp_path, capsys):
    rows = [{"text": _doc(f, i), "int_score": i % 3} for f in range(4) for i in range(6)]
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pq" / "a.parquet", row_group_size=3)
    argv = ["tokenizer", "--input", str(tmp_path / "pq"), "--vocab-size", "300", "--max-chars", "3000",
            "--held-out-chars", "1500", "--filter", "int_score>=1", "--quiet"]
    assert main(argv + ["--output", str(tmp_path / "t1")]) == 0
    printed = capsys.readouterr().out
    assert "held-out documents" in printed and "bytes per token" in printed, printed
    assert main(argv + ["--output", str(tmp_path / "t2")]) == 0
    configs = [json.loads((tmp_path / t / "tokenizer_config.json").read_text()) for t in ("t1", "t2")]
    assert configs[0]["hash"] == configs[1]["hash"]
    corpus = configs[0]["training_corpus"]
    assert corpus["skipped"] == {"filtered out by int_score>=1": corpus["skipped"]["filtered out by int_score>=1"]}
    assert corpus["skipped"]["filtered out by int_score>=1"] > 0 and corpus["text_chars"] >= 3000
