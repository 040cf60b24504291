"""Storage servers on 127.0.0.1 for the tests and benchmarks of streamed shards (nothing here reaches beyond
loopback).

- FileServer: a threaded HTTP server of a directory that counts the GETs of each object and injects faults: a
  fraction of answers are 503s or connections reset mid-body, some objects answer 404 (`missing`), some have a byte
  flipped (`flip`), `stall_s` pauses in the middle of every body, and `down()` / `up()` stop and restart it on the
  same port.
- S3Server: moto's ThreadedMotoServer (moto[server], a dev requirement) speaking the S3 HTTP API, with a bucket
  filled from a local directory; `fault_proxy()` puts a TCP proxy in front that resets a fraction of connections.
"""
from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

LOOPBACK = "127.0.0.1"


class FileServer:
    """http://127.0.0.1:PORT/ serving `root`; `hits` counts GETs per path. fail_rate: the fraction of GETs that
    fail (half 503, half reset after part of the body), drawn from a seeded generator."""

    def __init__(self, root, fail_rate: float = 0.0, seed: int = 0, missing=(), flip=(), stall_s: float = 0.0):
        self.root, self.fail_rate, self.stall_s = Path(root), fail_rate, stall_s
        self.missing, self.flip = set(missing), set(flip)
        self.flip_once: dict[str, bool] = {}  # names whose next GET only is altered (a transfer damaged on the way)
        self.hits: Counter = Counter()
        self.failures = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._port = 0
        self._server = None
        self.up()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self._port}"

    def up(self) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                return None

            def do_GET(self):
                server._serve(self)

            def do_HEAD(self):
                server._head(self)

        self._server = ThreadingHTTPServer((LOOPBACK, self._port), Handler)
        self._server.daemon_threads = True
        self._port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True, name="file-server").start()

    def down(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    close = down

    def _fault(self) -> str | None:
        with self._lock:
            if self.fail_rate and self._rng.random() < self.fail_rate:
                self.failures += 1
                return "503" if self._rng.random() < 0.5 else "reset"
        return None

    def _head(self, handler: BaseHTTPRequestHandler) -> None:
        """The size of a file, without its body (no faults injected; not counted in `hits`)."""
        name = handler.path.lstrip("/")
        path = self.root / name
        if name in self.missing or not path.is_file():
            handler.send_response(404)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        handler.send_response(200)
        handler.send_header("Content-Length", str(path.stat().st_size))
        handler.end_headers()

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        name = handler.path.lstrip("/")
        path = self.root / name
        with self._lock:
            self.hits[name] += 1
        fault = self._fault()
        if fault == "503":
            handler.send_error(503, "injected")
            return
        if name in self.missing or not path.is_file():
            handler.send_error(404, "no such object")
            return
        data = bytearray(path.read_bytes())
        if name in self.flip or self.flip_once.pop(name, False):
            data[len(data) // 2] ^= 0x01
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if fault == "reset":
            handler.wfile.write(data[:len(data) // 3])
            handler.wfile.flush()
            _reset(handler.connection)
            handler.close_connection = True
            return
        if self.stall_s:  # a slow store: half the body, a pause, the rest
            handler.wfile.write(data[:len(data) // 2])
            handler.wfile.flush()
            time.sleep(self.stall_s)
            data = data[len(data) // 2:]
        handler.wfile.write(data)


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0), as a dropped connection looks to the client."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class S3Server:
    """moto's S3 on 127.0.0.1 (fake credentials set in the environment), `endpoint` for data.s3_endpoint."""

    def __init__(self):
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                           ("AWS_DEFAULT_REGION", "us-east-1")):
            os.environ.setdefault(key, value)
        self._server = ThreadedMotoServer(ip_address=LOOPBACK, port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self._proxies: list[FaultProxy] = []

    def client(self, endpoint: str | None = None):
        import boto3

        return boto3.client("s3", endpoint_url=endpoint or self.endpoint, region_name="us-east-1")

    def put_dir(self, local_dir, bucket: str, prefix: str = "") -> str:
        """Upload every file of `local_dir` (recursively) to s3://bucket/prefix; returns that URL."""
        client = self.client()
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        root = Path(local_dir)
        for path in sorted(root.rglob("*")):
            if path.is_file():
                key = "/".join(filter(None, [prefix.strip("/"), path.relative_to(root).as_posix()]))
                client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
        return f"s3://{bucket}/{prefix.strip('/')}".rstrip("/")

    def fault_proxy(self, reset_rate: float, seed: int = 0) -> FaultProxy:
        proxy = FaultProxy(self.endpoint.rsplit(":", 1)[1], reset_rate, seed)
        self._proxies.append(proxy)
        return proxy

    def close(self) -> None:
        for proxy in self._proxies:
            proxy.close()
        self._server.stop()


class FaultProxy:
    """A TCP proxy on 127.0.0.1 to a local port that resets a `reset_rate` fraction of connections (after reading
    the request, before any answer). `endpoint`: its URL."""

    def __init__(self, target_port, reset_rate: float, seed: int = 0):
        self.target = (LOOPBACK, int(target_port))
        self.reset_rate, self._rng, self.resets = reset_rate, random.Random(seed), 0
        self._listener = socket.create_server((LOOPBACK, 0))
        self.endpoint = f"http://{LOOPBACK}:{self._listener.getsockname()[1]}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        if self._rng.random() < self.reset_rate:
            self.resets += 1
            try:
                client.recv(65536)
            except OSError:
                pass
            _reset(client)
            return
        upstream = socket.create_connection(self.target)
        threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
        _pipe(client, upstream)

    def close(self) -> None:
        self._closed = True
        self._listener.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
