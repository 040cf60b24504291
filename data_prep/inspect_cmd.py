"""`python -m data_prep inspect SHARD_DIR`: counts, checksum and structure checks, a decoded sample."""
from __future__ import annotations

from pathlib import Path

from .errors import DataPrepError
from .manifest import check_tokenizer_hash, packing_of, read_manifest, shard_problem
from .packing import describe_packing
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
    _print_packing(manifest, out)
    print(f"  files: {counts['files_listed']} listed, {counts['files_used']} used, {counts['files_skipped']} "
          f"skipped {counts['skipped_by_reason']}; {counts['replaced_bytes']} invalid UTF-8 bytes replaced in "
          f"{counts['files_with_replaced_bytes']} files; {counts['text_bytes']} bytes of text", file=out)


def _print_packing(manifest: dict, out) -> None:
    """The packing mode and what it cost, in total and per split."""
    record = packing_of(manifest)
    stream_tokens = sum(info.get("stream_tokens", 0) for info in manifest["splits"].values())
    print(f"  {describe_packing(record, stream_tokens)}", file=out)
    per_split = [f"{split} {f['dropped_tokens']} dropped, {f['padded_tokens']} padded"
                 + ("" if f.get("cut_documents") is None else f", {f['cut_documents']} documents cut")
                 for split, f in sorted(record["splits"].items())]
    print(f"    by split: {'; '.join(per_split)}", file=out)


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


def _check_remote_shards(source, manifest: dict, verify: str, progress: bool, out) -> int:
    """A streamed shard set read as the loader reads it: each shard fetched through the node cache (which checks its
    size and sha256 on arrival) and its members checked; --verify none checks nothing."""
    from tqdm import tqdm

    entries = [e for split in sorted(manifest["splits"]) for e in manifest["splits"][split]["shards"]]
    if verify == "none":
        print(f"checksums: not checked (--verify none), {len(entries)} shards", file=out)
        return 0
    bad = 0
    for entry in tqdm(entries, desc="fetching and checking", unit="shard", disable=not progress):
        try:
            ShardRows(source.shard_path(entry), entry, manifest["row_len"], manifest["dtype"],
                      manifest["tokenizer"]["vocab_size"])
        except DataPrepError as err:
            bad += 1
            print(f"  BAD {entry['name']}: {err}", file=out)
    print(f"checksums (sha256, on download): {len(entries) - bad} of {len(entries)} shards OK", file=out)
    return bad


def _remote_tokenizer(source, manifest: dict, into: Path) -> Path:
    """The shard set's tokenizer copy downloaded into `into` (its files: tokenizer.json, its config and the
    verification sample)."""
    from .tokenizer import CONFIG_FILE, SAMPLE_FILE, TOKENIZER_FILE

    folder = into / "tokenizer"
    folder.mkdir(parents=True, exist_ok=True)
    copy = manifest["tokenizer"]["copy"]
    for name in (TOKENIZER_FILE, CONFIG_FILE, SAMPLE_FILE):
        try:
            (folder / name).write_bytes(source.store.read(f"{copy}/{name}"))
        except Exception as err:  # noqa: BLE001 - the store's errors, whatever they are: reported as a problem
            if name != SAMPLE_FILE:
                raise DataPrepError(f"{source.store.object_url(copy + '/' + name)} cannot be read ({err})",
                                    "pass --tokenizer DIR, or upload the shard set again") from None
    return folder


def inspect_shards(shard_dir, verify: str = "full", tokenizer_dir=None, split: str = "train",
                   sample_tokens: int = 96, progress: bool = True, out=None, s3_endpoint: str | None = None) -> int:
    """Print a report on a shard directory, or on a shard set at an s3:// or http(s):// URL (read as the loader reads
    it: the manifest, then every shard through the node cache); returns the number of problems found (0 = good)."""
    import sys
    import tempfile

    from .paths import is_url

    out = out or sys.stdout
    if is_url(str(shard_dir)):
        with tempfile.TemporaryDirectory(prefix="data_prep-inspect-") as work:
            return _inspect_remote(str(shard_dir), verify, tokenizer_dir, split, sample_tokens, progress, out,
                                   Path(work), s3_endpoint)
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
    return problems + _sample(shard_dir, tok, split, sample_tokens, out)


def _inspect_remote(url: str, verify, tokenizer_dir, split, sample_tokens, progress, out, work: Path,
                    s3_endpoint: str | None) -> int:
    from .sources import open_source

    source = open_source(url, cache_dir=work / "cache", s3_endpoint=s3_endpoint)
    try:
        manifest = source.manifest()
        _print_counts(manifest, out)
        problems = _check_remote_shards(source, manifest, verify, progress, out)
        try:
            tok_dir = Path(tokenizer_dir) if tokenizer_dir else _remote_tokenizer(source, manifest, work)
            tok = load_tokenizer(tok_dir)
            check_tokenizer_hash(manifest, tok.hash, f"tokenizer {url}/{manifest['tokenizer']['copy']}")
        except DataPrepError as err:
            print(f"tokenizer: {err}", file=out)
            return problems + 1
        print(f"tokenizer {tokenizer_dir or url + '/' + manifest['tokenizer']['copy']}: hash matches the manifest",
              file=out)
        return problems + _sample(source, tok, split, sample_tokens, out)
    finally:
        source.close()


def _sample(shard_dir, tok, split: str, sample_tokens: int, out) -> int:
    """Decode the first row of `split` (`shard_dir`: a directory or a ShardSource); returns 1 when it cannot be
    read."""
    try:
        dataset = ShardDataset(shard_dir, split, verify="none", on_corrupt="skip")
        if len(dataset):
            row = dataset[0]
            print(f"sample ({split} row {int(dataset.row_ids([0])[0])}, first {sample_tokens} of "
                  f"{len(row)} tokens):\n  ids {row[:16].tolist()} ...\n  text {tok.decode(row[:sample_tokens])!r}",
                  file=out)
    except DataPrepError as err:
        print(f"sample: {err}", file=out)
        return 1
    return 0
