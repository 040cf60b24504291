"""Parquet over work units against the text-directory path, on the same text, side by side in one run.

The shared corpus (../shared/data/corpus: novels and chapters) is written once as a directory of text files and
once as FineWeb-Edu-style parquet (text, id, url, score, int_score, token_count; row groups of 64 documents); a
tokenizer of vocab 32768 is trained on a sample of --sample-chars characters (default 2e8: the whole corpus when it
is smaller); then both are sharded at seq 2048 with one worker, and the MB/s and tokens/s per worker are printed
beside each other, with what they mean for FineWeb-Edu 100BT (~450 GB of parquet text) on 16 nodes of 64 cores.

    python benchmarks/data_prep_formats.py [--corpus ../shared/data/corpus] [--work DIR] [--workers 1]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FINEWEB_TEXT_BYTES = 450e9  # FineWeb-Edu sample-100BT's text, as the issue sizes it


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=str(REPO.parent / "shared" / "data" / "corpus"))
    p.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--sample-chars", type=float, default=2e8)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--nodes", type=int, default=16)
    p.add_argument("--cores", type=int, default=64, help="cores (workers) per node for the projection")
    return p.parse_args(argv)


def write_inputs(corpus: Path, work: Path) -> tuple[Path, Path, int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_prep.text_io import normalise_text

    text_dir, parquet_dir = work / "text", work / "parquet"
    text_dir.mkdir(parents=True)
    parquet_dir.mkdir()
    rows, total = [], 0
    for i, path in enumerate(sorted(p for p in corpus.rglob("*.txt") if p.is_file())):
        name = path.relative_to(corpus).as_posix().replace("/", "__")
        text = normalise_text(path.read_bytes())[0]
        (text_dir / name).write_text(text, encoding="utf-8")
        total += len(text.encode())
        rows.append({"text": text, "id": name, "url": f"https://example.org/{name}", "score": 3.0, "int_score": 3,
                     "token_count": len(text) // 4})
    pq.write_table(pa.Table.from_pylist(rows), parquet_dir / "000_00000.parquet", row_group_size=64)
    return text_dir, parquet_dir, total


def run(cmd: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "data_prep", *cmd], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{done.stderr}")
    return time.perf_counter() - start, done.stdout


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="megaloop-formats-"))
    text_dir, parquet_dir, text_bytes = write_inputs(Path(args.corpus), work)
    # a corpus smaller than the sample asked for: train on 95% of it, so that held-out documents remain
    sample = min(args.sample_chars, 0.95 * text_bytes)
    seconds, printed = run(["tokenizer", "--input", str(parquet_dir), "--output", str(work / "tok"), "--vocab-size",
                            str(args.vocab_size), "--max-chars", str(sample), "--quiet"])
    trained = json.loads((work / "tok" / "tokenizer_config.json").read_text())["training_corpus"]
    held = [line for line in printed.splitlines() if line.startswith("bytes per token")]
    print(f"tokenizer: vocab {args.vocab_size} on a sample of {trained['text_chars'] / 1e6:.1f}M characters from "
          f"the parquet ({args.sample_chars:.0e} asked; the corpus holds {text_bytes / 1e6:.0f} MB) in {seconds:.1f} s "
          f"= {trained['text_bytes'] / 1e6 / seconds:.2f} MB/s; {held[0] if held else ''}")
    common = ["--tokenizer", str(work / "tok"), "--seq-len", str(args.seq_len), "--workers", str(args.workers),
              "--quiet", "--overwrite"]
    rates = {}
    for label, inputs, extra in (("text directory (one stream)", text_dir, []),
                                 ("parquet (work units)", parquet_dir, ["--id-field", "id"])):
        out = work / ("out_" + label.split()[0])
        seconds, _ = run(["shards", "--input", str(inputs), "--output", str(out), *common, *extra])
        manifest = json.loads((out / "manifest.json").read_text())
        tokens = sum(s["stream_tokens"] for s in manifest["splits"].values())
        rates[label] = (text_bytes / 1e6 / seconds / args.workers, tokens / seconds / args.workers)
    print(f"{'shards at seq ' + str(args.seq_len) + ', per worker':<34} {'MB/s':>8} {'tokens/s':>12}")
    for label, (mbs, tps) in rates.items():
        print(f"{label:<34} {mbs:8.2f} {tps:12,.0f}")
    mbs = rates["parquet (work units)"][0]
    workers = args.nodes * args.cores
    one = FINEWEB_TEXT_BYTES / 1e6 / mbs
    read_s = FINEWEB_TEXT_BYTES / (args.nodes * 1e9)
    print(f"FineWeb-Edu 100BT (~{FINEWEB_TEXT_BYTES / 1e9:.0f} GB of text) at {mbs:.2f} MB/s per worker: "
          f"{one / 3600:.1f} h on one worker; on {args.nodes} nodes x {args.cores} workers "
          f"{one / workers / 60:.1f} min of encoding, so reading the input bounds it (at 1 GB/s per node: "
          f"{read_s / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
