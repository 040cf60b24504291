"""Shard sources: where ShardDataset gets the manifest and each shard's local, memory-mappable file.

`ShardSource` is the one interface: a local directory (LocalSource: the files are there, checked by the manifest's
sizes or checksums at start-up as before) or a streamed store (StreamSource: S3 or HTTP behind the node cache;
every shard's size and sha256 are checked as it arrives, before any of its rows is used). The loader's order and
state do not depend on the source, so the same dataset gives the same stream from anywhere.
"""
from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from .errors import CorruptShardError, DataPrepError
from .manifest import MANIFEST_FILE, check_manifest_layout, read_manifest, verify_shards
from .node_cache import ShardCache
from .stores import RetryPolicy, StoreError, is_remote, open_store, retrying


class ShardSource(Protocol):
    """A shard directory's manifest and files."""

    url: str
    streams: bool  # True: shards arrive on demand (checked on arrival); False: all are local (checked at start)

    def manifest(self) -> dict:
        """The parsed, checked manifest."""

    def verify(self, manifest: dict, mode: str, splits: list[str]) -> dict[str, str]:
        """{shard name: problem} found at start-up under verification `mode` (full | fast | none)."""

    def shard_path(self, entry: dict) -> Path:
        """The local file of shard `entry`, complete and verified (downloaded now when it has to be)."""

    def prefetch(self, entries: list[dict]) -> None:
        """Start getting these shards in the background (nothing for a local directory)."""

    def stats(self) -> dict:
        """bytes_downloaded, downloads, hits, hit_ratio, retries, evicted (zeros for a local directory)."""

    def close(self) -> None:
        """Stop background work."""


class LocalSource:
    """A directory written by `python -m data_prep shards`."""

    streams = False

    def __init__(self, shard_dir):
        self.root = Path(shard_dir)
        self.url = str(shard_dir)

    def manifest(self) -> dict:
        return read_manifest(self.root)

    def verify(self, manifest: dict, mode: str, splits: list[str]) -> dict[str, str]:
        return verify_shards(self.root, manifest, mode, splits=splits)

    def shard_path(self, entry: dict) -> Path:
        return self.root / entry["name"]

    def prefetch(self, entries: list[dict]) -> None:
        return None

    def stats(self) -> dict:
        return {"bytes_downloaded": 0, "downloads": 0, "hits": 0, "hit_ratio": 1.0, "retries": 0, "evicted": 0}

    def close(self) -> None:
        return None


class StreamSource:
    """Shards in a ByteStore (s3://, http(s)://), read through a node cache, prefetched by `workers` threads."""

    streams = True

    def __init__(self, url: str, cache_dir=None, cache_gib: float | None = None, s3_endpoint: str | None = None,
                 policy: RetryPolicy | None = None, workers: int = 2):
        self.url, self.policy = url, policy or RetryPolicy()
        self.store = open_store(url, self.policy, s3_endpoint)
        self.cache = ShardCache(self.store, cache_dir, None if cache_gib is None else int(cache_gib * 2 ** 30),
                                self.policy)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="data_prep-download")
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._manifest = None

    def manifest(self) -> dict:
        """Read first: the manifest says which shards exist and their checksums."""
        if self._manifest is None:
            url = self.store.object_url(MANIFEST_FILE)
            try:
                raw = retrying(lambda: self.store.read(MANIFEST_FILE), url, self.policy)
            except StoreError as err:
                if err.missing:
                    raise DataPrepError(f"{url} does not exist", "pass the URL the dataset was uploaded to (the "
                                        "manifest is written last, so an interrupted upload has none: upload "
                                        "again)") from None
                raise
            try:
                manifest = json.loads(raw)
            except json.JSONDecodeError as err:
                raise DataPrepError(f"{url} is not valid JSON ({err})", "upload the dataset again") from None
            check_manifest_layout(manifest, url)
            self._manifest = manifest
        return self._manifest

    def verify(self, manifest: dict, mode: str, splits: list[str]) -> dict[str, str]:
        return {}  # every shard is checked (size and sha256) when it arrives, whatever `mode` says

    def shard_path(self, entry: dict) -> Path:
        with self._lock:
            pending = self._pending.pop(entry["name"], None)
        if pending is not None:
            try:
                return pending.result()
            except (StoreError, CorruptShardError):
                pass  # fetched again below, so the error is raised (and counted) on this thread
        try:
            return self.cache.fetch(entry)
        except StoreError as err:
            if err.missing:
                raise CorruptShardError(entry["name"], f"missing from the store ({err.url})",
                                        "re-upload the dataset, or train without the shard with "
                                        "data.on_corrupt=skip (counted)") from None
            raise

    def prefetch(self, entries: list[dict]) -> None:
        with self._lock:
            for entry in entries:
                if entry["name"] not in self._pending:
                    self._pending[entry["name"]] = self._pool.submit(self.cache.fetch, entry)

    def stats(self) -> dict:
        return self.cache.stats.as_dict()

    def close(self) -> None:
        """Stop the downloads: no new attempt starts (one under way ends within the store's timeout)."""
        self.cache.stop.set()
        with self._lock:
            for future in self._pending.values():
                future.cancel()
            self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)


def open_source(spec, cache_dir=None, cache_gib: float | None = None, s3_endpoint: str | None = None,
                policy: RetryPolicy | None = None) -> ShardSource:
    """The source of `spec`: a ShardSource as it is, s3:// or http(s):// streamed, anything else a directory."""
    if hasattr(spec, "shard_path"):
        return spec
    if is_remote(spec):
        return StreamSource(str(spec), cache_dir, cache_gib, s3_endpoint, policy)
    return LocalSource(spec)
