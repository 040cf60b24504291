"""Rank 0's commit of a staged save, retention, and the wait other ranks may do for the commit.

Commit order (each step durable before the next, so a crash at any point leaves the previous ``latest`` valid):
every rank's partial manifest (or a failure file) -> ``manifest.json`` -> ``COMMIT`` -> rename of the staging
directory to ``step_XXXXXXXX`` -> ``latest`` replaced atomically -> retention. A failure or a timeout writes
``ABORTED`` into the staging directory instead and commits nothing; the next successful commit deletes it.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

from . import files
from .errors import CheckpointError
from .writer import write_aborted


class CommitError(RuntimeError):
    """The save was not committed: a rank failed or did not finish in time."""


def commit(root: Path, step: int, token: str, world_size: int, timeout_s: float, keep: int,
           parts_written: threading.Event | None = None) -> Path:
    """Merge the partial manifests, mark the staging directory committed, publish it as ``latest``; returns its
    final path. On a rank's failure or a timeout: writes ABORTED and raises CommitError naming the rank.
    `parts_written`: set by another thread once it knows every rank is done with its part (a collective); the wait
    for the parts then lists the directory once a second, and at once when it is set."""
    tmp = root / files.tmp_dir_name(step, token)
    try:
        parts = _wait_for_parts(tmp, token, world_size, timeout_s, parts_written)
        _mark_committed(tmp, step, token, parts)
    except Exception as exc:
        try:
            write_aborted(tmp, token, str(exc))
        except OSError:
            pass
        raise CommitError(str(exc)) from exc
    final = _publish(root, tmp, step, token)
    apply_retention(root, keep, final)
    return final


def _mark_committed(tmp: Path, step: int, token: str, parts: list[dict]) -> None:
    """manifest.json (every rank's files), then COMMIT, each fsynced: COMMIT present means everything is on disk."""
    merged = {}
    for rank, part in enumerate(parts):
        twice = sorted(set(merged) & set(part["files"]))
        if twice or part.get("algorithm") != files.HASH_ALGORITHM:
            raise CommitError(f"rank {rank} recorded {twice[:3] or part.get('algorithm')} inconsistently with "
                              "the other ranks; every rank must run the same checkpoints version")
        merged.update(part["files"])
    files.write_file(tmp / "manifest.json", _json_bytes({
        "format": files.FORMAT + "-manifest", "step": step, "token": token,
        "algorithm": files.HASH_ALGORITHM, "files": dict(sorted(merged.items()))}))
    for rank in range(len(parts)):
        (tmp / files.manifest_part_name(rank)).unlink(missing_ok=True)
    files.write_file(tmp / "COMMIT", _json_bytes({"step": step, "token": token, "time": time.time()}))
    files.fsync_dir(tmp)


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=1) + "\n").encode()


def _wait_for_parts(tmp: Path, token: str, world_size: int, timeout_s: float,
                    parts_written: threading.Event | None = None) -> list[dict]:
    """Every rank's partial manifest. Each poll is one listing of the staging directory; only files that newly
    appeared are opened, and polls slow down to one a second (files.poll; one a second from the start when
    `parts_written` can cut the wait short), so a save of many ranks costs the file system a few listings and one
    read per rank, not a read per rank per poll."""
    parts: dict[int, dict] = {}
    wanted = {files.manifest_part_name(r): r for r in range(world_size)}
    failed = {files.failed_name(r): r for r in range(world_size)}

    def all_in():
        try:
            present = [e.name for e in os.scandir(tmp)]
        except FileNotFoundError:
            return False
        for name in present:
            if name in failed:
                raise CommitError(f"rank {failed[name]} failed: {_read_field(tmp / name, 'error')}")
        for name in present:
            r = wanted.get(name)
            if r is None or r in parts:
                continue
            try:
                part = files.read_json(tmp / name)
            except (OSError, ValueError):
                continue
            if part.get("token") == token:
                parts[r] = part
        return len(parts) == world_size

    try:
        files.poll(all_in, timeout_s, "every rank's partial manifest", wake=parts_written)
    except TimeoutError:
        missing = sorted(set(range(world_size)) - set(parts))
        raise CommitError(f"ranks {missing} did not finish writing {tmp.name} within {timeout_s:.0f} s "
                          "(check those ranks' logs; raise commit_timeout_s for slow file systems)") from None
    return [parts[r] for r in range(world_size)]


def _publish(root: Path, tmp: Path, step: int, token: str) -> Path:
    """Rename the staging directory to its final name (moving an existing one of that step aside), then point
    ``latest`` at it."""
    final = root / files.step_dir_name(step)
    aside = root / f"{final.name}.old-{token}"
    if final.exists():
        os.rename(final, aside)
    os.rename(tmp, final)
    files.fsync_dir(root)
    files.atomic_write_text(root / "latest", final.name + "\n")
    shutil.rmtree(aside, ignore_errors=True)
    return final


def apply_retention(root: Path, keep: int, current: Path) -> list[Path]:
    """Delete committed checkpoints beyond the newest `keep` (never `current`, never the one ``latest`` names),
    staging directories left by earlier saves and stale temporary ``latest`` files. Each victim is renamed first so
    that a half-deleted directory never looks committed. Returns the deleted checkpoint paths."""
    protect = {current.name, files.read_latest(root)}
    committed = files.committed_dirs(root)
    victims = [p for p in committed[keep:] if p.name not in protect]
    for path in victims:
        aside = root / f"{path.name}.old-{os.urandom(4).hex()}"
        os.rename(path, aside)
        shutil.rmtree(aside, ignore_errors=True)
    for path in root.iterdir():
        if files.is_staging_dir(path.name):
            shutil.rmtree(path, ignore_errors=True)
        elif path.name.startswith("latest.tmp-"):       # left by a crash between writing and replacing `latest`
            path.unlink(missing_ok=True)
    return victims


def wait_committed(root, step: int, timeout_s: float = 600.0, token: str | None = None) -> Path:
    """Block until rank 0 committed `step` under `root` (for ranks other than 0, which cannot see the commit);
    with `token` (SaveResult.token) only that save counts. Returns the committed directory; CheckpointError when
    that save was aborted, TimeoutError after `timeout_s`."""
    root = Path(root)
    final = root / files.step_dir_name(step)
    aborted = root / files.tmp_dir_name(step, token) / "ABORTED" if token else None

    def done():
        if aborted is not None and aborted.is_file():
            reason = _read_field(aborted, "reason")
            raise CheckpointError(f"the save of step {step} was aborted ({reason}); resume from the previous "
                                  "checkpoint and fix the cause")
        try:
            return files.is_committed(final) and (token is None or files.read_json(final / "COMMIT")["token"] == token)
        except (OSError, ValueError, KeyError):
            return False

    files.poll(done, timeout_s, f"the commit of {final}")
    return final


def _read_field(path: Path, key: str) -> str:
    try:
        return str(files.read_json(path).get(key))
    except (OSError, ValueError, AttributeError) as exc:
        return f"unreadable {path.name}: {exc}"
