"""`python -m data_prep inspect SHARD_DIR`: counts, checksum and structure checks, a decoded sample."""
from __future__ import annotations

from pathlib import Path

from .errors import DataPrepError
from .manifest import check_tokenizer_hash, read_manifest, shard_problem
from .shard_reader import ShardDataset, ShardRows
from .tokenizer import load_tokenizer


def _print_counts(manifest: dict, out) -> None:
    counts = manifest["counts"]
    print(f"seq_len {manifest['seq_len']} (rows of {manifest['row_len']} {manifest['dtype']} tokens), "
          f"tokenizer {manifest['tokenizer']['hash'][:16]}... vocab {manifest['tokenizer']['vocab_size']}, "
          f"encoder {manifest['tokenizer']['encoder']}", file=out)
    for split, info in sorted(manifest["splits"].items()):
        print(f"  {split:5s}: {info['rows']} rows, {info['tokens']} tokens, {info['documents']} documents, "
              f"{len(info['shards'])} shards, {info['dropped_tail_tokens']} tail tokens dropped, "
              f"{info['padded_tokens']} padded", file=out)
    print(f"  files: {counts['files_listed']} listed, {counts['files_used']} used, {counts['files_skipped']} "
          f"skipped {counts['skipped_by_reason']}; {counts['replaced_bytes']} invalid UTF-8 bytes replaced in "
          f"{counts['files_with_replaced_bytes']} files; {counts['text_bytes']} bytes of text", file=out)


def _check_shards(shard_dir: Path, manifest: dict, verify: str, progress: bool, out) -> int:
    """Checksums (per `verify`) and member structure of every shard; returns the number of bad shards."""
    from tqdm import tqdm

    entries = [e for split in sorted(manifest["splits"]) for e in manifest["splits"][split]["shards"]]
    bad = 0
    for entry in tqdm(entries, desc=f"checking ({verify})", unit="shard", disable=not progress):
        problem = shard_problem(shard_dir, entry, verify)
        if problem is None and verify != "none":
            try:
                ShardRows(shard_dir / entry["name"], entry, manifest["row_len"], manifest["dtype"],
                          manifest["tokenizer"]["vocab_size"])
            except DataPrepError as err:
                problem = str(err)
        if problem:
            bad += 1
            print(f"  BAD {entry['name']}: {problem}", file=out)
    if verify == "none":
        print(f"checksums: not checked (--verify none), {len(entries)} shards", file=out)
    else:
        print(f"checksums ({verify}): {len(entries) - bad} of {len(entries)} shards OK", file=out)
    return bad


def inspect_shards(shard_dir, verify: str = "full", tokenizer_dir=None, split: str = "train",
                   sample_tokens: int = 96, progress: bool = True, out=None) -> int:
    """Print a report on a shard directory; returns the number of problems found (0 = all good)."""
    import sys

    out = out or sys.stdout
    shard_dir = Path(shard_dir)
    manifest = read_manifest(shard_dir)
    _print_counts(manifest, out)
    problems = _check_shards(shard_dir, manifest, verify, progress, out)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir else shard_dir / manifest["tokenizer"]["copy"]
    try:
        tok = load_tokenizer(tok_dir)
        check_tokenizer_hash(manifest, tok.hash, f"tokenizer {tok_dir}")
    except DataPrepError as err:
        print(f"tokenizer: {err}", file=out)
        return problems + 1
    print(f"tokenizer {tok_dir}: hash matches the manifest", file=out)
    try:
        dataset = ShardDataset(shard_dir, split, verify="none", on_corrupt="skip")
        if len(dataset):
            row = dataset[0]
            print(f"sample ({split} row {int(dataset.row_ids([0])[0])}, first {sample_tokens} of "
                  f"{len(row)} tokens):\n  ids {row[:16].tolist()} ...\n  text {tok.decode(row[:sample_tokens])!r}",
                  file=out)
    except DataPrepError as err:
        print(f"sample: {err}", file=out)
        problems += 1
    return problems
