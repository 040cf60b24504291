"""The scale's training data: the corpus tokenized once into WORK/shards/<scale> with data_prep's CLI (tokenizer
trained on the first bytes of the corpus, then shards of seq_len + 1 token rows), reused by every point and every
re-run while the corpus is unchanged."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from megaloop.config import ConfigError
from megaloop.repro.sizes import SIZES
from megaloop.repro.study import Scale


def corpus_for(scale: Scale) -> Path:
    """The text the scale tokenizes: the corpus, or (smoke) links to its first files in sorted order."""
    if not scale.corpus.exists():
        raise ConfigError("--corpus", str(scale.corpus), "does not exist; give a directory of .txt files (the "
                          "shared corpus is ../shared/data/corpus beside the checkout)")
    limit = SIZES[scale.name]["corpus_files"]
    if limit is None:
        return scale.corpus
    files = [scale.corpus] if scale.corpus.is_file() else sorted(p for p in scale.corpus.rglob("*.txt"))[:limit]
    if not files:
        raise ConfigError("--corpus", str(scale.corpus), "holds no .txt files")
    sub = scale.work / "corpus" / scale.name
    sub.mkdir(parents=True, exist_ok=True)
    for i, f in enumerate(files):
        link = sub / f"{i:04d}_{f.name}"
        if not link.exists():
            link.symlink_to(f.resolve())
    return sub


def prepare(scale: Scale, quiet: bool = True) -> Path:
    """WORK/shards/<scale>, made now unless it already holds shards of this corpus (synth testbed: WORK/shards/
    synth-<scale>, the scale's k-hop dataset)."""
    if scale.testbed == "synth":
        return prepare_synth(scale)
    out = scale.work / "shards" / scale.name
    corpus = corpus_for(scale)
    if (out / "manifest.json").is_file():
        from data_prep.manifest import corpus_mismatch

        problem = corpus_mismatch(str(out), str(corpus))
        if not problem:
            return out
        raise ConfigError("--corpus", str(scale.corpus), f"differs from the corpus the shards in {out} were made from "
                          f"({problem}); use another --work, or delete {out} and the runs made on it")
    s = SIZES[scale.name]
    tok = scale.work / "shards" / f"{scale.name}-tokenizer"
    q = ["--quiet"] if quiet else []
    _run([sys.executable, "-m", "data_prep", "tokenizer", "--input", str(corpus), "--output", str(tok),
          "--vocab-size", str(s["vocab_size"]), "--max-bytes", str(s["tokenizer_bytes"]), "--overwrite", *q])
    _run([sys.executable, "-m", "data_prep", "shards", "--input", str(corpus), "--tokenizer", str(tok),
          "--output", str(out), "--seq-len", str(s["seq_len"]), "--val-fraction", str(s["val_fraction"]), "--shard-size", "4096",
          "--packing", "stream", "--overwrite", *q])  # books and chapters: best fit would keep a row of each
    return out


def prepare_synth(scale: Scale) -> Path:
    """WORK/shards/synth-<scale>: the scale's synth dataset, written by `python -m data_prep synth` unless its
    manifest already records these options (the generator is deterministic, so equal options mean equal bytes)."""
    import json

    from megaloop.repro.sizes import SYNTH_SIZES

    s = SYNTH_SIZES[scale.name]
    out = scale.work / "shards" / f"synth-{scale.name}"
    want = {"task": s["task"], "hops": list(s["hops"]), "rows": s["rows"], "val_rows": s["val_rows"], "seed": 0,
            "seq_len": s["seq_len"]}
    try:
        have = json.loads((out / "manifest.json").read_text()).get("parameters", {})
    except (FileNotFoundError, json.JSONDecodeError):
        have = {}
    if all(have.get(k) == v for k, v in want.items()):
        return out
    _run([sys.executable, "-m", "data_prep", "synth", "--task", s["task"], "--out", str(out),
          "--hops", f"{s['hops'][0]}..{s['hops'][1]}", "--rows", str(s["rows"]), "--val-rows", str(s["val_rows"]),
          "--seq-len", str(s["seq_len"]), "--seed", "0", "--overwrite"])
    return out


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"{' '.join(cmd[1:4])} failed (exit {done.returncode}): {tail[0]}")
