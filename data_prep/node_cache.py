"""The node cache of streamed shards: bounded, least-recently-used eviction, one download per shard per node.

Layout: CACHE_DIR/<store key>/<sha256[:16]>-<shard name>, where the store key is a hash of the store's URL and
the file name carries the shard's checksum from the manifest (a re-uploaded dataset never meets a stale copy). A shard becomes visible only complete and verified: it is downloaded to a temporary name
(.FILE.part-PID-THREAD-SIZE), its size and sha256 are compared with the manifest, then it is renamed into place (atomic
on one file system). A killed download leaves only a .part file, which no reader opens and the next cache on the
node deletes (its process is gone).

Every rank of a node may ask for the same shard at once: the download runs under an exclusive lock on
NAME.lock (fcntl.flock; one open file each, so threads of one process exclude each other too); whoever gets the lock
second finds the shard in place and counts a hit. The bound (cache_bytes) counts the complete shards in the
directory and the full sizes of the downloads under way: before a download, under a directory-wide lock, the least
recently used shards (modification time, refreshed on every hit) are deleted until the new one fits, and its
temporary file is created, reserving its size for the other downloaders. A deleted shard stays readable to a process that has it memory-mapped (POSIX unlink), and
a reader that finds its shard gone before opening it fetches it again (StreamSource.open_shard).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from .errors import CorruptShardError, DataPrepError
from .stores import ByteStore, RetryPolicy, StoreError, retrying

PART = ".part-"  # .FILE.part-PID-THREAD-SIZE: a download under way (SIZE: the bytes it reserves)
ROOM_LOCK = ".room.lock"  # held while a download makes room and reserves it


def default_cache_dir() -> Path:
    """Node-local temporary storage: $MEGALOOP_SHARD_CACHE, else $TMPDIR/megaloop-shards."""
    return Path(os.environ.get("MEGALOOP_SHARD_CACHE") or Path(tempfile.gettempdir()) / "megaloop-shards")


class CacheStats:
    """What one process's cache did: downloads (with bytes and retries) and hits."""

    def __init__(self):
        self.lock = threading.Lock()
        self.bytes_downloaded = self.downloads = self.hits = self.retries = self.evicted = 0

    def add(self, **counts) -> None:
        with self.lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    @property
    def hit_ratio(self) -> float:
        asked = self.hits + self.downloads
        return self.hits / asked if asked else 1.0

    def as_dict(self) -> dict:
        return {"bytes_downloaded": self.bytes_downloaded, "downloads": self.downloads, "hits": self.hits,
                "hit_ratio": self.hit_ratio, "retries": self.retries, "evicted": self.evicted}


class ShardCache:
    """Local copies of a store's shards: `fetch(entry)` -> the path of the verified file."""

    def __init__(self, store: ByteStore, cache_dir=None, cache_bytes: int | None = None,
                 policy: RetryPolicy | None = None):
        self.store, self.policy = store, policy or RetryPolicy()
        key = hashlib.sha256(store.url.encode()).hexdigest()[:16]
        self.dir = Path(cache_dir or default_cache_dir()) / key
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cache_bytes = cache_bytes
        self.stats = CacheStats()
        self.stop = threading.Event()  # set when the reader closes: retries and waits for room end
        self._remove_dead_parts()

    def path(self, entry: dict) -> Path:
        """Where shard `entry` lives in the cache: named by its sha256 too, so a dataset re-uploaded under the same
        URL with other content never meets a stale copy."""
        return self.dir / f"{entry['sha256'][:16]}-{entry['name']}"

    def fetch(self, entry: dict) -> Path:
        """The verified local copy of shard `entry` (manifest entry: name, size, sha256), downloading it once."""
        final = self.path(entry)
        if self._touch(final):
            self.stats.add(hits=1)
            return final
        with self._locked(f"{final.name}.lock"):
            if self._touch(final):  # another rank of this node downloaded it meanwhile
                self.stats.add(hits=1)
                return final
            tmp = final.with_name(f".{final.name}{PART}{os.getpid()}-{threading.get_ident()}-{entry['size']}")
            while True:  # room for it, reserved by its temporary file (the other downloaders count it)
                with self._locked(ROOM_LOCK):
                    if self._make_room(entry):
                        tmp.touch()
                        break
                if self.stop.wait(0.05):  # the room is reserved by downloads under way: they end, then count
                    raise StoreError(self.store.object_url(entry["name"]), "the reader closed before the object "
                                     "arrived")
            written = self._download(entry, final, tmp)
        self.stats.add(downloads=1, bytes_downloaded=written)
        return final

    def _download(self, entry: dict, final: Path, tmp: Path) -> int:
        """Into `tmp`, checked against the manifest's size and sha256, then renamed to `final`."""
        url = self.store.object_url(entry["name"])

        def attempt():  # a failed attempt's partial file is overwritten by the next ("wb")
            with open(tmp, "wb") as out:
                written = _Hashing(out)
                self.store.download(entry["name"], written)
                return written

        try:
            written = retrying(attempt, url, self.policy, on_retry=lambda: self.stats.add(retries=1), stop=self.stop)
            problem = _problem(written, entry)
            if problem:
                raise CorruptShardError(entry["name"], f"downloaded from {url}: {problem}",
                                        "re-upload the shard (`python -m data_prep upload`) or train without it "
                                        "with data.on_corrupt=skip (counted)")
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        return entry["size"]

    def _make_room(self, entry: dict) -> bool:
        """Delete least recently used shards until `entry` fits beside the rest and the downloads under way;
        False when those downloads alone leave too little room (the caller waits for them)."""
        if self.cache_bytes is None:
            return True
        if entry["size"] > self.cache_bytes:
            raise DataPrepError(f"shard {entry['name']} ({entry['size']} bytes) is larger than data.cache_gib "
                                f"({self.cache_bytes / 2 ** 30:.3f} GiB)", "raise data.cache_gib")
        files, used = [], 0
        for path in self.dir.iterdir():
            if path.name.endswith(".lock"):
                continue
            if PART in path.name:  # a download under way: its expected size is reserved
                used += int(path.name.rsplit("-", 1)[1])
                continue
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime, st.st_size, path))
        used += sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if used + entry["size"] <= self.cache_bytes:
                break
            path.unlink(missing_ok=True)
            used -= size
            self.stats.add(evicted=1)
        return used + entry["size"] <= self.cache_bytes

    def used_bytes(self) -> int:
        """Bytes of the shards in the cache now (complete ones, and what downloads under way have written)."""
        total = 0
        for path in self.dir.iterdir():
            if not path.name.endswith(".lock"):
                try:
                    total += path.stat().st_size
                except FileNotFoundError:
                    pass
        return total

    @staticmethod
    def _touch(path: Path) -> bool:
        try:
            os.utime(path)  # the LRU clock
            return True
        except FileNotFoundError:
            return False

    @contextmanager
    def _locked(self, name: str):
        with open(self.dir / name, "a+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _remove_dead_parts(self) -> None:
        """Delete the temporary files of downloads whose process is gone (killed mid-download)."""
        for path in self.dir.glob(f".*{PART}*"):
            pid = path.name.rsplit(PART, 1)[1].split("-")[0]
            if pid.isdigit() and not _alive(int(pid)):
                path.unlink(missing_ok=True)


class _Hashing:
    """A file wrapper that hashes what is written (so a shard is read once, while it arrives)."""

    def __init__(self, out):
        self.out, self.digest, self.size = out, hashlib.sha256(), 0

    def write(self, chunk) -> int:
        self.digest.update(chunk)
        self.size += len(chunk)
        return self.out.write(chunk)


def _problem(written: _Hashing, entry: dict) -> str | None:
    """What is wrong with a downloaded shard (size, then sha256 against the manifest), or None."""
    if written.size != entry["size"]:
        return f"{written.size} bytes, the manifest records {entry['size']}"
    actual = written.digest.hexdigest()
    if actual != entry["sha256"]:
        return f"checksum mismatch: sha256 {actual[:16]}..., the manifest records {entry['sha256'][:16]}..."
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


__all__ = ["ShardCache", "CacheStats", "default_cache_dir", "StoreError"]
