"""Byte stores: where a shard directory's files live. One Protocol, three kinds (a local directory, S3 or an
S3-compatible store through boto3, HTTP(S) through the standard library's client).

A store only moves whole objects: `read` (small ones: the manifest), `download` (stream one object into an open
file) and `upload`. Every call goes through `retrying`: connection resets, timeouts, 5xx and 429 answers are retried
with exponential backoff (plus jitter) up to `RetryPolicy.attempts`; a missing object (404 / NoSuchKey) is not
transient and fails at once. Both failures are a `StoreError` whose message names the object's URL.

webdataset's own URL opener (`webdataset.gopen`) runs `curl` in a subprocess per shard; megaloop needs the retry
decisions above (which answer is transient) and byte counts, so HTTP goes through urllib here. The shards
themselves are ordinary webdataset tar files (`webdataset.WebDataset(url)` reads them from the same URLs).
"""
from __future__ import annotations

import http.client
import os
import random
import shutil
import socket
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Protocol

from .errors import DataPrepError

CHUNK = 1 << 20
REMOTE_SCHEMES = ("s3://", "http://", "https://")


class StoreError(DataPrepError):
    """An object could not be read or written (after the retries, when the failure was transient)."""

    def __init__(self, url: str, problem: str, remedy: str = "", missing: bool = False):
        self.url, self.missing = url, missing
        super().__init__(f"{url}: {problem}", remedy)


class TransientError(Exception):
    """A failure worth retrying (connection reset, timeout, 5xx); `retrying` turns the last one into StoreError."""


@dataclass
class RetryPolicy:
    """attempts: tries per call (>= 1); backoff_s: the first wait, doubled after each failure (capped at
    max_backoff_s), with up to 25% random jitter so that ranks do not retry in lockstep."""

    attempts: int = 6
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    timeout_s: float = 60.0

    def budget_s(self) -> float:
        """The longest the waits between attempts add up to (without jitter)."""
        return sum(min(self.backoff_s * 2 ** i, self.max_backoff_s) for i in range(self.attempts - 1))


def retrying(call: Callable, url: str, policy: RetryPolicy, on_retry: Callable | None = None,
             stop: threading.Event | None = None):
    """call() with retries on TransientError; a StoreError naming `url` once the attempts are used up. `stop` set
    (the reader is closing) ends the retries at once."""
    stop = stop or threading.Event()
    for attempt in range(policy.attempts):
        if stop.is_set():
            raise StoreError(url, "the reader closed before the object arrived")
        try:
            return call()
        except TransientError as err:
            last = err
            if on_retry is not None:
                on_retry()
            if attempt + 1 < policy.attempts:
                wait = min(policy.backoff_s * 2 ** attempt, policy.max_backoff_s)
                stop.wait(wait * (1 + 0.25 * random.random()))
    raise StoreError(url, f"failed {policy.attempts} times in a row (last: {last})",
                     "check that the store is reachable (endpoint, network, credentials); raise data.retries or "
                     "data.retry_backoff_s to wait longer for a store that recovers")


class ByteStore(Protocol):
    """Whole objects under one base URL, by relative name."""

    url: str

    def object_url(self, name: str) -> str:
        """The URL of object `name` (for messages)."""

    def read(self, name: str) -> bytes:
        """The object's bytes (one attempt; StoreError(missing=True) when absent, TransientError to retry)."""

    def download(self, name: str, out: BinaryIO) -> int:
        """Write the object into `out` from its current position; the bytes written (one attempt)."""

    def upload(self, path: Path, name: str) -> None:
        """Store a local file as object `name` (one attempt)."""

    def delete(self, name: str) -> None:
        """Remove object `name` if it exists (one attempt)."""

    def size(self, name: str) -> int:
        """The size in bytes of object `name` without reading it (StoreError with missing=True when absent)."""


class LocalStore:
    """A directory."""

    def __init__(self, root):
        self.root = Path(root)
        self.url = str(self.root)

    def object_url(self, name: str) -> str:
        return str(self.root / name)

    def read(self, name: str) -> bytes:
        try:
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            raise StoreError(self.object_url(name), "no such file", missing=True) from None

    def download(self, name: str, out: BinaryIO) -> int:
        try:
            with open(self.root / name, "rb") as source:
                return _copy(source, out)
        except FileNotFoundError:
            raise StoreError(self.object_url(name), "no such file", missing=True) from None

    def upload(self, path: Path, name: str) -> None:
        target = self.root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.part-{os.getpid()}")
        shutil.copyfile(path, tmp)
        os.replace(tmp, target)

    def delete(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def size(self, name: str) -> int:
        try:
            return (self.root / name).stat().st_size
        except FileNotFoundError:
            raise StoreError(self.object_url(name), "no such file", missing=True) from None


class HttpStore:
    """Objects under an http:// or https:// base URL (read-only)."""

    def __init__(self, url: str, policy: RetryPolicy):
        self.url, self.policy = url.rstrip("/"), policy

    def object_url(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _open(self, name: str, method: str = "GET"):
        url = self.object_url(name)
        try:
            return urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=self.policy.timeout_s)
        except urllib.error.HTTPError as err:
            if err.code == 404:
                raise StoreError(url, "HTTP 404: no such object", "check data.shards and that the dataset was "
                                 "uploaded completely", missing=True) from None
            if err.code >= 500 or err.code in (408, 429):
                raise TransientError(f"HTTP {err.code} {err.reason}") from None
            raise StoreError(url, f"HTTP {err.code} {err.reason}", "check the URL and the server's access rules") \
                from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
            raise TransientError(_describe(err)) from None

    def read(self, name: str) -> bytes:
        return read_by_download(self, name)

    def download(self, name: str, out: BinaryIO) -> int:
        with self._open(name) as response:
            expected = response.headers.get("Content-Length")
            try:
                written = _copy(response, out)
            except (OSError, http.client.HTTPException) as err:
                raise TransientError(_describe(err)) from None
        if expected is not None and written != int(expected):
            raise TransientError(f"connection closed after {written} of {expected} bytes")
        return written

    def upload(self, path: Path, name: str) -> None:
        self.delete(name)

    def size(self, name: str) -> int:
        with self._open(name, "HEAD") as response:
            length = response.headers.get("Content-Length")
        if length is None:
            raise StoreError(self.object_url(name), "the server gave no Content-Length",
                             "serve the file from a server that answers HEAD with its size")
        return int(length)

    def delete(self, name: str) -> None:
        raise StoreError(self.object_url(name), "HTTP stores are read-only here",
                         "upload to s3://bucket/prefix or a local directory, and serve that over HTTP")


class S3Store:
    """Objects under s3://bucket/prefix, through boto3 (credentials and region from the standard environment
    variables and config files; `endpoint` for S3-compatible stores, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL)."""

    def __init__(self, url: str, policy: RetryPolicy, endpoint: str | None = None):
        import boto3
        from botocore.config import Config as BotoConfig

        self.url, self.policy = url.rstrip("/"), policy
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise DataPrepError(f"{url} names no bucket", "write s3://BUCKET/PREFIX")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        config = BotoConfig(retries={"total_max_attempts": 1}, connect_timeout=policy.timeout_s,
                            read_timeout=policy.timeout_s)
        session = boto3.session.Session()
        self.client = session.client("s3", endpoint_url=endpoint, config=config,
                                     region_name=session.region_name or "us-east-1")

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def object_url(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.key(name)}"

    def _call(self, name: str, call):
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

        try:
            return call()
        except (NoCredentialsError, PartialCredentialsError) as err:  # not transient: no retry helps
            raise StoreError(self.object_url(name), f"no usable S3 credentials ({err})",
                             "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, ~/.aws/credentials)") \
                from None
        except ClientError as err:
            code = str(err.response.get("Error", {}).get("Code", ""))
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in ("NoSuchKey", "404", "NotFound"):
                raise StoreError(self.object_url(name), "no such object", "check data.shards and that the dataset "
                                 "was uploaded completely", missing=True) from None
            if code == "NoSuchBucket":
                raise StoreError(self.object_url(name), "no such bucket", "check the bucket name in data.shards "
                                 "and data.s3_endpoint", missing=True) from None
            if status >= 500 or status in (408, 429) or code in ("SlowDown", "RequestTimeout", "InternalError"):
                raise TransientError(f"{code} (HTTP {status})") from None
            raise StoreError(self.object_url(name), f"{code} (HTTP {status}): {err}",
                             "check the credentials (AWS_* variables or ~/.aws) and the bucket's permissions") \
                from None
        except (BotoCoreError, OSError, http.client.HTTPException) as err:
            raise TransientError(_describe(err)) from None

    def read(self, name: str) -> bytes:
        return read_by_download(self, name)

    def download(self, name: str, out: BinaryIO) -> int:
        def get():
            body = self.client.get_object(Bucket=self.bucket, Key=self.key(name))["Body"]
            try:
                return _copy(body, out)
            finally:
                body.close()

        return self._call(name, get)

    def upload(self, path: Path, name: str) -> None:
        def put():
            with open(path, "rb") as handle:
                self.client.put_object(Bucket=self.bucket, Key=self.key(name), Body=handle)

        self._call(name, put)

    def delete(self, name: str) -> None:
        self._call(name, lambda: self.client.delete_object(Bucket=self.bucket, Key=self.key(name)))

    def size(self, name: str) -> int:
        return int(self._call(name, lambda: self.client.head_object(Bucket=self.bucket,
                                                                      Key=self.key(name)))["ContentLength"])


def read_by_download(store: ByteStore, name: str) -> bytes:
    """A whole object as bytes, through the store's own download (its retries, checks and byte counts)."""
    out = _Buffer()
    store.download(name, out)
    return bytes(out.data)


class _Buffer:
    def __init__(self):
        self.data = bytearray()

    def write(self, chunk) -> int:
        self.data += chunk
        return len(chunk)


def _copy(source, out) -> int:
    """Copy until EOF, writing what arrives (read1: no wait for a whole chunk when the source has one)."""
    read = getattr(source, "read1", source.read)
    written = 0
    while chunk := read(CHUNK):
        out.write(chunk)
        written += len(chunk)
    return written


def _describe(err: BaseException) -> str:
    reason = getattr(err, "reason", None)
    if isinstance(reason, BaseException):
        err = reason
    if isinstance(err, socket.timeout | TimeoutError):
        return f"timed out ({err})"
    return f"{type(err).__name__}: {err}"


def is_remote(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(REMOTE_SCHEMES)


def open_store(spec, policy: RetryPolicy | None = None, s3_endpoint: str | None = None) -> ByteStore:
    """The store of a local directory, s3://bucket/prefix or http(s)://host/path."""
    policy = policy or RetryPolicy()
    spec = str(spec)
    if spec.startswith("s3://"):
        return S3Store(spec, policy, s3_endpoint)
    if spec.startswith(("http://", "https://")):
        return HttpStore(spec, policy)
    return LocalStore(spec)
