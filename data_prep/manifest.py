"""manifest.json of a shard directory: reading, writing, checksum verification, tokenizer matching.

The manifest is written last, after every shard is closed, so a directory with a manifest is complete. Its main
fields: format/format_version, seq_len, row_len, dtype, tokenizer {hash, vocab_size, bos_id, eos_id, pad_id,
encoder}, parameters (the creation options that shape the output), splits {train, val: rows, tokens, documents,
shards [{name, rows, first_row, size, sha256, data_offset, stride}]}, sources [{path, size, sha256, split, tokens,
replaced_bytes, skipped}], counts (files, skipped files by reason, replaced bytes), packing {mode, buffer,
bos_framed, rows_start_at_bos, dropped_tokens, padded_tokens, cut_documents, splits {split: the three figures}}
(data_prep.packing). A manifest without `packing` was written before packing was recorded: stream packing
(`packing_of` reads either).

Format version 2 added each shard's member layout (data_offset, stride), so that readers never scan a tar archive.
A version-1 directory is refused with the command that adds it (`python -m data_prep reindex --shards DIR`).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .errors import CorruptShardError, DataPrepError, TokenizerMismatchError

MANIFEST_FILE = "manifest.json"
FORMAT = "megaloop-data_prep-shards"
FORMAT_VERSION = 2
UNIT_FORMAT_VERSION = 3  # written over work units: shards may name members from their unit's start (member_first)
READABLE_VERSIONS = (FORMAT_VERSION, UNIT_FORMAT_VERSION)
UNINDEXED_VERSION = 1  # the shards are the same; the manifest lacks the member offsets


def reindex_command(shard_dir) -> str:
    """The command that adds member offsets to a version-1 manifest."""
    return f"python -m data_prep reindex --shards {shard_dir}"
VERIFY_MODES = ("full", "fast", "none")
HASH_CHUNK = 1 << 22


def write_manifest(out_dir, manifest: dict) -> Path:
    """Write manifest.json (sorted keys, fixed layout, ASCII escapes so that any file name can be stored: equal
    content gives equal bytes)."""
    path = Path(out_dir) / MANIFEST_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True, ensure_ascii=True) + "\n", encoding="ascii")
    os.replace(tmp, path)
    return path


def read_manifest(shard_dir) -> dict:
    """Parse and sanity-check the manifest of a shard directory."""
    path = Path(shard_dir) / MANIFEST_FILE
    if not path.is_file():
        raise DataPrepError(f"{shard_dir} has no {MANIFEST_FILE}",
                            "pass a directory written by `python -m data_prep shards` (the manifest is written last; "
                            "a directory without one is incomplete: run the command again, with --overwrite where it "
                            "left shards there)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataPrepError(f"{path} is not valid JSON ({err})", "re-create the shards") from err
    if isinstance(manifest, dict) and manifest.get("format") == FORMAT \
            and manifest.get("format_version") == UNINDEXED_VERSION:
        raise DataPrepError(f"{path} has no member offsets (format version {UNINDEXED_VERSION}, written before "
                            "readers stopped scanning the tar files)",
                            f"run `{reindex_command(shard_dir)}` once (it scans each shard and rewrites the "
                            "manifest), or re-create the shards")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or manifest.get("format_version") not in READABLE_VERSIONS:
        raise DataPrepError(f"{path} is not a data_prep manifest of version {' or '.join(map(str, READABLE_VERSIONS))}",
                            "re-create the shards with this version of data_prep")
    check_manifest_layout(manifest, path)
    return manifest


def check_manifest_layout(manifest: dict, path) -> None:
    """The fields every reader relies on are there, and the row length agrees with seq_len (row = seq_len + 1)."""
    remedy = ("re-create the shards with `python -m data_prep shards` (an edited or foreign manifest does not match "
              "them)")
    try:
        seq_len, row_len = manifest["seq_len"], manifest["row_len"]
        manifest["dtype"], manifest["tokenizer"]["hash"], manifest["tokenizer"]["vocab_size"]
        for info in manifest["splits"].values():
            for entry in info["shards"]:
                entry["name"], entry["rows"], entry["first_row"], entry["size"], entry["sha256"]
                entry["data_offset"], entry["stride"]
    except (KeyError, TypeError, AttributeError) as err:
        raise DataPrepError(f"{path} lacks a field every shard directory has ({type(err).__name__}: {err})",
                            remedy) from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (seq_len, row_len)) or row_len != seq_len + 1:
        raise DataPrepError(f"{path} records seq_len {seq_len!r} but rows of {row_len!r} tokens (row_len); a row holds "
                            "seq_len + 1 tokens, so the manifest contradicts its own rows", remedy)


def packing_of(manifest: dict) -> dict:
    """The manifest's packing record; for a manifest written before packing was recorded, the stream packing those
    versions did, its figures from the split counts (cut_documents unknown: None) and `recorded` False."""
    if "packing" in manifest:
        return manifest["packing"]
    splits = {split: {"dropped_tokens": info.get("dropped_tail_tokens", 0),
                      "padded_tokens": info.get("padded_tokens", 0), "cut_documents": None}
              for split, info in manifest["splits"].items()}
    return {"mode": "stream", "buffer": None, "bos_framed": True, "rows_start_at_bos": False, "recorded": False,
            "dropped_tokens": sum(f["dropped_tokens"] for f in splits.values()),
            "padded_tokens": sum(f["padded_tokens"] for f in splits.values()), "cut_documents": None,
            "splits": splits}


def manifest_fingerprint(manifest: dict) -> str:
    """A short stable id of a dataset: sha256 of the shard checksums and the row layout."""
    key = {"row_len": manifest["row_len"], "dtype": manifest["dtype"],
           "shards": {s: [(x["name"], x["sha256"]) for x in manifest["splits"][s]["shards"]]
                      for s in sorted(manifest["splits"])}}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def file_sha256(path) -> str:
    """sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(HASH_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def shard_problem(shard_dir, entry: dict, mode: str) -> str | None:
    """What is wrong with one shard under a verification mode ("full": sha256, "fast": size, "none"), or None."""
    if mode not in VERIFY_MODES:
        raise DataPrepError(f"unknown verification mode {mode!r}", f"use one of {VERIFY_MODES}")
    if mode == "none":
        return None
    path = Path(shard_dir) / entry["name"]
    if not path.is_file():
        return "file is missing"
    size = path.stat().st_size
    if size != entry["size"]:
        kind = "truncated" if size < entry["size"] else "longer than recorded"
        return f"{kind}: {size} bytes, the manifest records {entry['size']}"
    if mode == "full":
        actual = file_sha256(path)
        if actual != entry["sha256"]:
            return f"checksum mismatch: sha256 {actual[:16]}..., the manifest records {entry['sha256'][:16]}..."
    return None


def verify_shards(shard_dir, manifest: dict, mode: str = "full", splits=None) -> dict[str, str]:
    """{shard name: problem} for every shard of `splits` (default all) that fails verification."""
    problems = {}
    for split in splits or sorted(manifest["splits"]):
        for entry in manifest["splits"][split]["shards"]:
            problem = shard_problem(shard_dir, entry, mode)
            if problem:
                problems[entry["name"]] = problem
    return problems


def corrupt_shard_error(shard: str, problem: str) -> CorruptShardError:
    """The error raised for a shard that fails verification, with what to do."""
    return CorruptShardError(shard, problem,
                             "restore the file or re-create the shards with `python -m data_prep shards`; "
                             "to train without it, use on_corrupt='skip' (a megaloop config: data.on_corrupt=skip; "
                             "skipped shards are counted)")


def check_tokenizer_hash(manifest: dict, tokenizer_hash: str, source: str = "the given tokenizer") -> None:
    """Raise TokenizerMismatchError when `tokenizer_hash` is not the one the shards were made with."""
    recorded = manifest["tokenizer"]["hash"]
    if tokenizer_hash != recorded:
        raise TokenizerMismatchError(
            f"the shards were made with tokenizer {recorded[:16]}..., but {source} has hash {tokenizer_hash[:16]}...",
            "use the tokenizer the shards were made with (a copy is in SHARD_DIR/tokenizer), "
            "or re-create the shards with this tokenizer")


def corpus_mismatch(shard_dir, input_dir) -> str | None:
    """Why the shards in `shard_dir` were not made from the text files now in `input_dir` (another file set, or a
    file of another size), or None when they were. Uses the manifest's sources and its recorded --glob."""
    from .text_io import list_source_files

    try:
        manifest = read_manifest(shard_dir)
        recorded = {(s["path"], s["size"]) for s in manifest["sources"]}
        current = {(f.relpath, f.size) for f in list_source_files(input_dir, manifest["parameters"]["glob"])}
    except (DataPrepError, KeyError, TypeError) as err:
        return f"cannot compare with the corpus ({err})"
    if recorded == current:
        return None
    only_old, only_new = sorted(recorded - current), sorted(current - recorded)
    example = (f"{only_old[0][0]} ({only_old[0][1]} bytes) is not in {input_dir}" if only_old else
               f"{only_new[0][0]} ({only_new[0][1]} bytes) is new")
    return (f"they were made from another corpus ({len(only_old)} of their source files are not in {input_dir} as "
            f"they were, {len(only_new)} of its files are not among them; e.g. {example})")
