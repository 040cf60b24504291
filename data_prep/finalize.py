"""`data_prep finalize --output OUT`: once every work unit of OUT's plan is committed, link the units' shards into
OUT in unit order under global names (`{split}-{k:06d}.tar`), number their rows on (first_row; each shard keeps
its members' unit-relative names, recorded as member_first) and write manifest.json last (format 3).

The links are made in OUT/.incoming and published the way every prep publishes (the manifest moves in last), and
OUT/.prep is removed only after that: a finalize killed half-way leaves the committed units intact and is simply run
again. Runs by itself after a single invocation (or MPI job) that committed every unit.
"""
from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np

from . import __version__
from .errors import DataPrepError, NotEnoughTokensError
from .manifest import FORMAT, MANIFEST_FILE, UNIT_FORMAT_VERSION, write_manifest
from .packing import units_packing_record
from .prepare import SPLITS, TOKENIZER_SUBDIR, publish_outputs, staging_dir
from .shard_writer import shard_name
from .tokenizer import copy_tokenizer_files, load_tokenizer
from .unit_store import prep_dir, read_plan, read_unit, unit_dir


def _committed_summaries(out: Path, plan: dict) -> list[dict]:
    missing, summaries = [], []
    for unit in plan["units"]:
        try:
            summary = read_unit(out, unit["index"])
        except (OSError, ValueError):
            summary = None
        if summary is None or summary.get("key") != unit["key"]:
            missing.append(unit["index"])
        else:
            summaries.append(summary)
    if missing:
        raise DataPrepError(f"{out}: {len(missing)} of {len(plan['units'])} work units are not committed yet "
                            f"(first: unit {missing[0]})", "run the prep command (every --task of it) to the end, "
                            "then finalize again")
    return summaries


def _link_splits(out: Path, staging: Path, summaries: list[dict], seq_len: int) -> dict:
    splits = {}
    for split in SPLITS:
        shards, rows, number = [], 0, 0
        documents = stream_tokens = dropped = 0
        for summary in summaries:
            info = summary["splits"][split]
            documents += info["documents"]
            stream_tokens += info["stream_tokens"]
            dropped += info["dropped_tail_tokens"]
            for shard in info["shards"]:
                name = shard_name(split, number)
                os.link(unit_dir(out, summary["index"]) / shard["name"], staging / name)
                shards.append({**shard, "name": name, "first_row": rows, "member_first": shard["first_row"]})
                rows += shard["rows"]
                number += 1
        splits[split] = {"rows": rows, "tokens": rows * (seq_len + 1), "stream_tokens": stream_tokens,
                         "documents": documents, "padded_tokens": sum(s["splits"][split].get("padded_tokens", 0)
                                                                      for s in summaries),
                         "dropped_tail_tokens": dropped, "shards": shards}
    return splits


def _check_splits(splits: dict, val_fraction: float, seq_len: int) -> None:
    for split, wanted in (("train", True), ("val", val_fraction > 0)):
        info = splits[split]
        if wanted and info["rows"] == 0:
            raise NotEnoughTokensError(
                f"the {split} split has no row: {info['stream_tokens']} tokens in {info['documents']} documents, "
                f"packed within work units of rows of seq_len + 1 = {seq_len + 1} tokens",
                "add documents, lower --seq-len, raise --unit-mb or change --val-fraction")


def build_manifest(job: dict, tok, summaries: list[dict], splits: dict) -> dict:
    skipped: Counter = Counter()
    inputs = {}
    for summary in summaries:
        skipped.update(summary["skipped_by_reason"])
        inputs.update(summary["inputs"])
    used = sum(s["documents"] for s in summaries)
    counts = {"files_listed": len(inputs), "files_used": len(inputs), "files_skipped": 0, "text_bytes":
              sum(s["bytes"] for s in summaries), "replaced_bytes": 0, "files_with_replaced_bytes": 0,
              "documents_used": used, "documents_skipped": sum(skipped.values()),
              "skipped_by_reason": dict(sorted(skipped.items())), "units": len(summaries)}
    return {
        "format": FORMAT, "format_version": UNIT_FORMAT_VERSION, "data_prep_version": __version__,
        "seq_len": job["options"]["seq_len"], "row_len": job["options"]["seq_len"] + 1,
        "dtype": np.dtype(tok.token_dtype).name, "member_format": "{row:010d}.npy",
        "tokenizer": {"hash": tok.hash, "vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id,
                      "pad_id": tok.pad_id, "encoder": tok.encoder_name, "copy": TOKENIZER_SUBDIR},
        "parameters": job["options"], "splits": splits, "counts": counts,
        "packing": units_packing_record(job["options"], summaries),
        "rows": sum(s["rows"] for s in splits.values()), "tokens": sum(s["tokens"] for s in splits.values()),
        "inputs": [{"name": name, **inputs[name]} for name in sorted(inputs)],
    }


def finalize(out) -> dict:
    """Write OUT's dataset from its committed units (see the module docstring); returns the manifest."""
    out = Path(out)
    try:
        plan = read_plan(out)
    except (OSError, ValueError):
        if (out / MANIFEST_FILE).exists():
            raise DataPrepError(f"{out} is finalized already (manifest.json, no work units left)",
                                "nothing to do: train on it") from None
        raise DataPrepError(f"{out} holds no prep plan (.prep/plan.json)",
                            "run `python -m data_prep shards ... --output OUT` first") from None
    job = plan["job"]
    summaries = _committed_summaries(out, plan)
    tok = load_tokenizer(job["tokenizer"], encoder=job["encoder"])
    if tok.hash != job["tokenizer_hash"]:
        raise DataPrepError(f"the tokenizer at {job['tokenizer']} changed since the units were written",
                            "restore it, or prepare the shards again")
    staging = staging_dir(out)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        splits = _link_splits(out, staging, summaries, job["options"]["seq_len"])
        _check_splits(splits, job["options"]["val_fraction"], job["options"]["seq_len"])
        manifest = build_manifest(job, tok, summaries, splits)
        copy_tokenizer_files(tok, staging / TOKENIZER_SUBDIR)
        write_manifest(staging, manifest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish_outputs(staging, out)
    shutil.rmtree(prep_dir(out), ignore_errors=True)
    return manifest
