"""Best-fit packing against stream packing, on the bundled corpus and on a FineWeb-shaped parquet sample.

Corpora: the bundled corpus (data/sample_corpus: nine novels, one document each) as a text directory, and novels
(--web-novels of the shared corpus's, else the bundled ones) cut at line ends into documents of web-page-like
lengths (lognormal, median --median-chars characters; written as parquet with columns text and id, as FineWeb-Edu):
several times the 1,000-document buffer, so that best fit runs from a full buffer. A vocab-4096 tokenizer is
trained on the bundled corpus. Each corpus is sharded with --packing bestfit and --packing stream (one worker,
in this process) at the quickstart's seq_len 128 and at the reference's 2048, and for each the table gives MB/s
per worker, the fraction of tokens dropped, the fraction of rows that start at a document start (row[0] is BOS)
and the rows. At
seq 128 a quickstart-sized run (configs/parcae-tiny.yaml, --steps steps of 16 x 128 tokens, one process) is trained
on each and its validation loss at T = mu_rec read from summary.json (its own val split), plus `megaloop eval` of
the same run on the stream-packed val split of that corpus (the same rows for both packings: comparable). A last
table times the packers alone on the encoded web-shaped documents (rows of 2049, buffer 1000), against a best fit
that scans the buffer for each document instead of bisecting sorted lengths.

    python benchmarks/data_prep_packing.py [--corpus data/sample_corpus] [--web-source DIR] [--web-novels 30]
        [--work DIR] [--steps 100] [--no-train]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODES = ("bestfit", "stream")
SHARED_NOVELS = Path(os.environ.get("MEGALOOP_SHARED", REPO.parent / "shared")) / "data" / "corpus" / "novels"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=str(REPO / "data" / "sample_corpus"))
    p.add_argument("--web-source", default=str(SHARED_NOVELS if SHARED_NOVELS.is_dir() else REPO / "data" /
                                               "sample_corpus"),
                   help="novels cut into the web-shaped documents (default: the shared corpus's novels, else "
                   "--corpus's)")
    p.add_argument("--web-novels", type=int, default=30, help="how many of them (default 30: ~9,000 pages)")
    p.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--median-chars", type=int, default=2500, help="median web-page length in characters")
    p.add_argument("--steps", type=int, default=100, help="training steps of each quickstart-sized run")
    p.add_argument("--no-train", action="store_true", help="packing figures only")
    return p.parse_args(argv)


def web_like_documents(texts: list[str], median_chars: int = 2500, sigma: float = 0.9, seed: int = 0,
                       max_chars: int = 60_000) -> list[str]:
    """The texts cut at line ends into documents whose lengths follow a lognormal law (median `median_chars`, shape
    `sigma`, at most `max_chars` but for a single longer line), as web pages' do; deterministic for a seed. Blank
    lines inside a document stay; a document never starts or ends with one."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def target() -> int:
        return int(min(max_chars, median_chars * np.exp(sigma * rng.standard_normal())))

    docs: list[str] = []
    for text in texts:
        current, size, want = [], 0, target()
        for line in text.split("\n"):
            current.append(line)
            size += len(line) + 1
            if size >= want and line.strip():
                docs.append("\n".join(current).strip())
                current, size, want = [], 0, target()
        if "".join(current).strip():
            docs.append("\n".join(current).strip())
    return [d for d in docs if d]


def write_corpora(corpus: Path, web_source: Path, novels: int, work: Path, median_chars: int
                  ) -> dict[str, tuple[Path, list[str], int]]:
    """{name: (input, extra shards options, text bytes)}: the bundled text directory, and web-shaped parquet cut
    from the first `novels` novels of `web_source`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_prep.text_io import normalise_text

    files = sorted(p for p in corpus.glob("*.txt") if p.is_file())
    texts = [normalise_text(p.read_bytes())[0] for p in files]
    sources = sorted(p for p in web_source.glob("*.txt") if p.is_file())[:novels]
    docs = web_like_documents([normalise_text(p.read_bytes())[0] for p in sources], median_chars)
    parquet = work / "web"
    parquet.mkdir(parents=True)
    pq.write_table(pa.table({"text": docs, "id": [f"page-{i:06d}" for i in range(len(docs))]}),
                   parquet / "000_00000.parquet", row_group_size=256)
    print(f"corpora: {corpus} ({len(files)} documents, {sum(len(t.encode()) for t in texts) / 1e6:.1f} MB); "
          f"web-shaped parquet from {len(sources)} novels of {web_source}: {len(docs)} documents, median "
          f"{sorted(map(len, docs))[len(docs) // 2]:,} characters, {sum(len(d.encode()) for d in docs) / 1e6:.1f} MB")
    return {"bundled novels": (corpus, [], sum(len(t.encode()) for t in texts)),
            "FineWeb-shaped": (parquet, ["--id-field", "id"], sum(len(d.encode()) for d in docs))}


def shard(inputs: Path, tok: Path, out: Path, seq_len: int, packing: str, extra: list[str]) -> tuple[float, dict]:
    """`data_prep shards` in this process with one worker; (seconds, manifest)."""
    from data_prep.cli import main

    argv = ["shards", "--input", str(inputs), "--tokenizer", str(tok), "--output", str(out), "--seq-len",
            str(seq_len), "--workers", "1", "--packing", packing, "--quiet", "--overwrite", *extra]
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    if code != 0:
        sys.exit(f"failed: {' '.join(argv)}")
    return time.perf_counter() - start, json.loads((out / "manifest.json").read_text())


def document_starts(out: Path, manifest: dict) -> float:
    """The fraction of rows (both splits) whose first token is BOS, i.e. that start at a document's start."""
    import numpy as np

    from data_prep.shard_reader import ShardDataset

    starts = rows = 0
    for split in manifest["splits"]:
        data = ShardDataset(out, split, verify="none")
        first = data.read_rows(np.arange(len(data), dtype=np.int64))[:, 0] if len(data) else np.empty(0)
        starts += int((first == manifest["tokenizer"]["bos_id"]).sum())
        rows += len(first)
    return starts / max(rows, 1)


def train(shards: Path, run: Path, steps: int) -> subprocess.Popen:
    """A quickstart-sized run (parcae-tiny, one process, one thread) in the background."""
    sets = [f"data.shards={shards}", f"train.out_dir={run}", f"train.steps={steps}", "train.progress=false",
            f"train.val_every={steps}"]
    cmd = [sys.executable, "-m", "megaloop", "train", str(REPO / "configs" / "parcae-tiny.yaml"),
           *[a for s in sets for a in ("--set", s)]]
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def val_losses(run: Path, common: Path, depth: int) -> tuple[float, float]:
    """(the run's own final val loss at T=depth, `megaloop eval` of the run on the val split of `common`)."""
    own = json.loads((run / "summary.json").read_text())["val"][str(depth)]["val_loss"]
    done = subprocess.run([sys.executable, "-m", "megaloop", "eval", str(run), "--shards", str(common), "--tasks",
                           "val", "--depths", str(depth), "--json"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        sys.exit(f"megaloop eval {run} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout[done.stdout.index("{"):])
    return own, result["depths"][str(depth)]["loss"]


def naive_best_fit(lengths: list[int], row_len: int, buffer: int) -> int:
    """Best fit by scanning the buffer for every choice (the reference for the bisecting packer); returns rows."""
    pending, rows, space = [], 0, row_len

    def place() -> None:
        nonlocal rows, space
        fits = [i for i, n in enumerate(pending) if n <= space]
        pick = max(fits, key=pending.__getitem__) if fits else min(range(len(pending)), key=pending.__getitem__)
        space -= min(pending.pop(pick), space)
        if space == 0:
            rows, space = rows + 1, row_len

    for n in lengths:
        pending.append(n)
        while len(pending) >= buffer:
            place()
    while pending:
        place()
    return rows + (space < row_len)


def packer_speeds(tok_dir: Path, docs: list[str], row_len: int = 2049, buffer: int = 1000) -> dict[str, float]:
    """Million tokens a second through each packer alone, on the encoded documents."""
    import numpy as np

    from data_prep.packing import make_packer
    from data_prep.tokenizer import load_tokenizer

    tok = load_tokenizer(tok_dir, verify=False)
    encoded = [tok.encode_to_array(d) for d in docs]
    tokens = sum(len(e) + 2 for e in encoded)
    speeds = {}
    for mode in MODES:
        packer = make_packer(mode, row_len, tok.bos_id, tok.eos_id, tok.pad_id, np.uint16, buffer)
        start = time.perf_counter()
        for e in encoded:
            packer.add_document(e)
        packer.finish(True)
        speeds[mode] = tokens / (time.perf_counter() - start) / 1e6
    start = time.perf_counter()
    naive_best_fit([len(e) + 2 for e in encoded], row_len, buffer)
    speeds["bestfit, scanning the buffer"] = tokens / (time.perf_counter() - start) / 1e6
    return speeds


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="megaloop-packing-"))
    corpora = write_corpora(Path(args.corpus), Path(args.web_source), args.web_novels, work, args.median_chars)
    tok = work / "tok"
    from data_prep.cli import main as data_prep

    with contextlib.redirect_stdout(io.StringIO()):
        data_prep(["tokenizer", "--input", args.corpus, "--output", str(tok), "--vocab-size", "4096", "--quiet",
                   "--overwrite"])
    table = []
    for name, (inputs, extra, text_bytes) in corpora.items():
        for seq_len in (128, 2048):
            for mode in MODES:
                out = work / f"{name.split()[0]}-{seq_len}-{mode}"
                seconds, manifest = shard(inputs, tok, out, seq_len, mode, extra)
                packing = manifest["packing"]
                stream_tokens = sum(s["stream_tokens"] for s in manifest["splits"].values())
                table.append({"corpus": name, "seq": seq_len, "mode": mode, "mbs": text_bytes / 1e6 / seconds,
                              "dropped": packing["dropped_tokens"] / stream_tokens,
                              "starts": document_starts(out, manifest), "rows": manifest["splits"]["train"]["rows"],
                              "out": out})
    print("\n| corpus | seq_len | packing | MB/s per worker | tokens dropped | rows starting at a document | train "
          "rows |\n|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['corpus']} | {r['seq']} | {r['mode']} | {r['mbs']:.2f} | {r['dropped']:.1%} | "
              f"{r['starts']:.1%} | {r['rows']:,} |")
    if not args.no_train:
        train_table(table, work, args.steps)
    print("\n| packer alone (rows of 2049, buffer 1000, FineWeb-shaped documents) | M tokens/s |\n|---|---|")
    import pyarrow.parquet as pq

    docs = pq.read_table(corpora["FineWeb-shaped"][0] / "000_00000.parquet").column("text").to_pylist()
    for label, speed in packer_speeds(tok, docs).items():
        print(f"| {label} | {speed:.1f} |")
    return 0


def train_table(table: list[dict], work: Path, steps: int) -> None:
    """Train on each seq-128 shard set (the two packings of a corpus side by side: two processes, one thread each)
    and print their validation losses at T = mu_rec = 4."""
    rows = [r for r in table if r["seq"] == 128]
    lines, notes = [], []
    for corpus in dict.fromkeys(r["corpus"] for r in rows):
        pair = [r for r in rows if r["corpus"] == corpus]
        common = next(r["out"] for r in pair if r["mode"] == "stream")
        start = time.perf_counter()
        procs = {r["mode"]: (train(r["out"], work / f"run-{r['out'].name}", steps), r) for r in pair}
        for mode, (proc, r) in procs.items():
            _, err = proc.communicate()
            if proc.returncode != 0:
                sys.exit(f"training on {r['out']} failed:\n{err[-3000:]}")
        for mode, (_, r) in procs.items():
            own, shared = val_losses(work / f"run-{r['out'].name}", common, 4)
            lines.append(f"| {corpus} | {mode} | {own:.3f} | {shared:.3f} | {r['rows']:,} |")
        notes.append(f"{corpus}: {time.perf_counter() - start:.0f} s")
    print("\n| corpus | packing | val loss, own val split (T=4) | val loss, stream val rows (T=4) | train rows |\n"
          "|---|---|---|---|---|")
    print("\n".join(lines))
    print(f"({steps} steps of 16 x 128 tokens each, one seed, two runs side by side: {'; '.join(notes)})")


if __name__ == "__main__":
    sys.exit(main())
