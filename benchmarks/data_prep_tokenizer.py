"""Tokenizer benchmark: train on the whole shared corpus, then check every document.

Prints the training time (target <= 60 s on the 2-core development machine), whether decode(encode(doc)) == doc
and tiktoken ids == HF ids for every document, bytes per token, and the speed of both encoders. Usage (from the
repository root):

    python benchmarks/data_prep_tokenizer.py [--corpus ../shared/data/corpus] [--vocab-size 32768] [--output DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_prep.text_io import iter_documents, list_source_files  # noqa: E402  (after the path set-up)
from data_prep.tokenizer import train_tokenizer  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=str(REPO.parent / "shared" / "data" / "corpus"))
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--output", default=None, help="tokenizer directory to keep (default: a temporary one)")
    return parser.parse_args(argv)


def check_every_document(tok, corpus: Path) -> dict:
    """Round trip and tiktoken == HF on every document; returns counts and timings."""
    texts = [d.text for d in iter_documents(corpus, list_source_files(corpus)) if not d.skip_reason]
    start = time.perf_counter()
    fast_ids = [tok.fast.encode_ordinary(t) for t in texts]
    fast_seconds = time.perf_counter() - start
    start = time.perf_counter()
    hf_ids = [e.ids for e in tok.hf.encode_batch_fast(texts, add_special_tokens=False)]
    hf_seconds = time.perf_counter() - start
    mismatched = [i for i, (a, b) in enumerate(zip(fast_ids, hf_ids)) if a != b]
    not_round_trip = [i for i, (t, ids) in enumerate(zip(texts, fast_ids)) if tok.decode(ids) != t]
    text_bytes = sum(len(t.encode("utf-8")) for t in texts)
    return {"documents": len(texts), "text_bytes": text_bytes, "tokens": sum(map(len, hf_ids)),
            "fast_seconds": fast_seconds, "hf_seconds": hf_seconds, "mismatched": mismatched,
            "not_round_trip": not_round_trip}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.output:
        return run(args, Path(args.output))
    with tempfile.TemporaryDirectory(prefix="data_prep_tok_") as scratch:
        return run(args, Path(scratch) / "tokenizer")


def run(args, output: Path) -> int:
    """Train into `output`, check every document, print the figures; 0 when every check passed."""
    corpus = Path(args.corpus)
    cpu_start, start = time.process_time(), time.perf_counter()
    tok = train_tokenizer(corpus, output, args.vocab_size, overwrite=True, progress=False)
    seconds = time.perf_counter() - start
    corpus_info = tok.config["training_corpus"]
    print(f"training: {seconds:.1f} s wall ({time.process_time() - cpu_start:.1f} s CPU of this process, load "
          f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores) on {corpus_info['files']} files, "
          f"{corpus_info['text_bytes'] / 1e6:.1f} MB; vocab {tok.vocab_size}; target <= 60 s: "
          f"{'MET' if seconds <= 60 else 'MISSED'}")
    print(f"tokenizer {output} hash {tok.hash}; encoder {tok.encoder_name}")
    if tok.fast is None:
        print(f"fast encoder unavailable: {tok.fast_problem}")
        return 1
    result = check_every_document(tok, corpus)
    print(f"documents checked: {result['documents']}; tiktoken ids == HF ids: "
          f"{result['documents'] - len(result['mismatched'])}/{result['documents']}; decode(encode(doc)) == doc: "
          f"{result['documents'] - len(result['not_round_trip'])}/{result['documents']}")
    print(f"bytes per token: {result['text_bytes'] / result['tokens']:.3f} "
          f"({result['text_bytes']} bytes, {result['tokens']} tokens)")
    mb = result["text_bytes"] / 1e6
    print(f"encode speed: tiktoken {mb / result['fast_seconds']:.2f} MB/s (1 thread), "
          f"HF encode_batch_fast {mb / result['hf_seconds']:.2f} MB/s")
    return 0 if not result["mismatched"] and not result["not_round_trip"] else 1


if __name__ == "__main__":
    sys.exit(main())
