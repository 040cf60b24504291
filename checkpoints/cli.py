"""Command line for checkpoint directories: ``inspect`` (what is stored) and ``verify`` (are the bytes intact).

Exit codes: 0 fine, 1 verified and found corrupt, 2 bad input (missing directory, not a checkpoint). Errors are
one line on stderr, ``checkpoints: <what was wrong>; <what to do>``, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

from . import files
from .errors import CheckpointError, CorruptCheckpointError
from .load import CheckpointReader, find_checkpoints
from data_prep.paths import LocalPath

CORRUPT, BAD_INPUT = 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m checkpoints", description="Inspect and verify megaloop "
                                     "checkpoints (sharded zarr v3 directories).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("inspect", help="show step, tokens, layout and the arrays of a checkpoint",
                       description="Show a checkpoint's step, tokens, saving layout, schema version and arrays.")
    p.add_argument("dir", type=LocalPath(),
                   metavar="DIR", help="a checkpoint directory (step_XXXXXXXX) or a root holding 'latest'")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("verify", help="check every file against the manifest (sizes and checksums)",
                       description="Check sizes and checksums of every file against manifest.json. Exit 1 if "
                                   "corrupt.")
    p.add_argument("dir", type=LocalPath(),
                   metavar="DIR", help="a checkpoint directory or a root holding 'latest'")
    p.add_argument("--all", action="store_true", help="with a root: verify every committed checkpoint in it")
    p.set_defaults(func=cmd_verify)
    _add_convert_parsers(sub)
    return parser


def _add_convert_parsers(sub) -> None:
    """convert/export and export-hf/import-hf, each left out (with a note) when what it imports is missing."""
    for module, what in (("cli_convert", "convert/export"), ("hf.cli", "export-hf/import-hf")):
        try:
            loaded = importlib.import_module(f"{__package__}.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__package__}.{module}":
                print(f"checkpoints: {what} unavailable ({exc}); install what it names", file=sys.stderr)
            continue
        except ImportError as exc:
            print(f"checkpoints: {what} unavailable ({exc}); install what it names", file=sys.stderr)
            continue
        loaded.add_parsers(sub)


def resolve(dir_arg: str) -> Path:
    """A checkpoint directory from DIR: itself if it holds metadata.json, else the one its ``latest`` names (or
    its newest committed one)."""
    path = Path(dir_arg)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such directory; give a checkpoint directory or the root holding 'latest'")
    if (path / "metadata.json").is_file():
        return path
    found = find_checkpoints(path)
    if not found:
        aside = sorted(p.name for p in path.glob("step_*.corrupt"))
        held = (f" (it holds {len(aside)} set aside as corrupt, e.g. {aside[-1]}: verify one by its path)"
                if aside else "")
        raise CheckpointError(f"{path}: not a checkpoint directory and holds no committed checkpoint{held}; give a "
                              "step_XXXXXXXX directory or the root that holds 'latest'")
    return found[0]


def cmd_inspect(args) -> int:
    reader = CheckpointReader(resolve(args.dir))
    meta = reader.metadata
    arrays = {n: {"shape": list(a.shape), "dtype": a.dtype_name, "chunks": list(a.chunks), "bytes": a.nbytes}
              for n, a in sorted(reader.arrays.items())}
    summary = {"path": str(reader.path), "step": reader.step, "tokens": meta.get("tokens"),
               "layout": meta.get("layout"), "schema_version": meta["schema_version"], "arrays": arrays}
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    total = sum(a["bytes"] for a in arrays.values())
    for key in ("path", "step", "tokens", "layout", "schema_version"):
        value = summary[key]
        print(f"{key:<15} {json.dumps(value) if isinstance(value, (dict, list)) else value}")
    print(f"{'arrays':<15} {len(arrays)} ({_size(total)})")
    rows = [("array", "shape", "dtype", "chunks", "bytes")] + [
        (n, _dims(a["shape"]), a["dtype"], _dims(a["chunks"]), str(a["bytes"])) for n, a in arrays.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for row in rows:
        print("  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return 0


def cmd_verify(args) -> int:
    paths = [resolve(args.dir)]
    if args.all and not (Path(args.dir) / "metadata.json").is_file():
        paths = find_checkpoints(args.dir)
    status = 0
    for path in paths:
        status = max(status, _verify_one(path))
    return status


def _verify_one(path: Path) -> int:
    t0 = time.perf_counter()
    try:
        reader = CheckpointReader(path)
        problems = reader.problems()
    except CorruptCheckpointError as exc:
        problems = [str(exc)]
    if problems:
        print(f"CORRUPT {path}: {len(problems)} problem(s)")
        for p in problems[:10]:
            print(f"  {p}")
        return CORRUPT
    listed = reader.manifest["files"].values()
    print(f"OK {path}: step {reader.step}, {len(reader.arrays)} arrays, {len(listed)} files, "
          f"{_size(sum(f['size'] for f in listed))} verified ({files.HASH_ALGORITHM}) in "
          f"{time.perf_counter() - t0:.2f} s")
    return 0


def _dims(shape) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # e.g. piped into `head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (CheckpointError, OSError, ValueError) as exc:
        message = str(exc) if "; " in str(exc) else f"{exc}; check the path and try again"
        print(f"checkpoints: {message}", file=sys.stderr)
        return BAD_INPUT
