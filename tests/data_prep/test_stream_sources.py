"""Streamed shards against real servers on 127.0.0.1 (moto's S3, a local HTTP server): the same global batches as
the local directory under any dp, one download per shard per node, a bounded cache, atomic downloads, and the
faults (resets/503s retried, a missing or altered object named in one error or skipped and counted, a store that
stays down named after the retries)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from data_prep.errors import CorruptShardError, ResumeStateError
from data_prep.loader import ShardLoader
from data_prep.local_servers import FileServer, S3Server
from data_prep.manifest import read_manifest
from data_prep.node_cache import ShardCache
from data_prep.order import BlockOrder, GlobalOrder
from data_prep.sources import StreamSource
from data_prep.stores import HttpStore, RetryPolicy, StoreError

G, STEPS, W = 12, 6, 4
FAST = RetryPolicy(attempts=6, backoff_s=0.01, timeout_s=5.0)


def global_row_ids(source_factory, dp: int, steps: int = STEPS, **kwargs) -> np.ndarray:
    """[steps, G] row ids of the global batches, from dp loaders (rank shares concatenated in rank order)."""
    shares = []
    for rank in range(dp):
        loader = ShardLoader(source_factory(), G, rank, dp, seed=5, order="blocks", block_shards=W, prefetch=0,
                             **kwargs)
        batches = iter(loader)
        shares.append([next(batches)["row_id"].numpy() for _ in range(steps)])
        loader.close()
    return np.stack([np.concatenate([share[s] for share in shares]) for s in range(steps)])


@pytest.fixture(scope="module")
def servers(tiny_shards):
    s3 = S3Server()
    s3_url = s3.put_dir(tiny_shards, "corpus", "tiny")
    http = FileServer(tiny_shards)
    yield s3, s3_url, http
    http.close()
    s3.close()


def test_same_global_batches_from_local_s3_and_http_at_dp_1_and_2(servers, tiny_shards, tmp_path):
    s3, s3_url, http = servers
    local = global_row_ids(lambda: str(tiny_shards), 1)
    for dp in (1, 2):
        from_s3 = global_row_ids(lambda: StreamSource(s3_url, tmp_path / "s3", s3_endpoint=s3.endpoint,
                                                      policy=FAST), dp)
        from_http = global_row_ids(lambda: StreamSource(http.url, tmp_path / "http", policy=FAST), dp)
        assert np.array_equal(from_s3, local) and np.array_equal(from_http, local), dp
    # the tokens too, not only the ids
    a = next(iter(ShardLoader(str(tiny_shards), G, seed=5, order="blocks", block_shards=W, prefetch=0)))
    b = next(iter(ShardLoader(StreamSource(http.url, tmp_path / "http", policy=FAST), G, seed=5, order="blocks",
                              block_shards=W, prefetch=0)))
    assert np.array_equal(a["tokens"].numpy(), b["tokens"].numpy())


def test_block_order_visits_every_row_once_per_epoch_and_touches_few_shards():
    rows = np.array([7, 5, 9, 6, 8, 3, 7, 5, 6, 4])
    order = BlockOrder(rows, seed=1, block_shards=3)
    n = int(rows.sum())
    visited, epochs = order.rows_at(np.arange(2 * n))
    assert sorted(visited[:n]) == list(range(n)) and sorted(visited[n:]) == list(range(n))
    assert not np.array_equal(visited[:n], visited[n:])  # each epoch its own order
    assert np.array_equal(epochs, np.repeat([0, 1], n))
    again, _ = BlockOrder(rows, seed=1, block_shards=3).rows_at(np.arange(n + 5, n - 5, -1))  # any order of asking
    assert np.array_equal(again, visited[n - 4:n + 6][::-1])
    shard_of = np.searchsorted(np.cumsum(rows), visited[:n], side="right")
    # consecutive windows of 8 positions lie in one block of 3 shards (or straddle two blocks)
    assert max(len(set(shard_of[i:i + 8])) for i in range(n - 8)) <= 6
    full = GlobalOrder(n, seed=1).rows_at(np.arange(n))[0]
    full_shards = np.searchsorted(np.cumsum(rows), full, side="right")
    assert max(len(set(full_shards[i:i + 8])) for i in range(n - 8)) > 6


def test_four_ranks_of_a_node_download_each_shard_once(tiny_shards, tmp_path):
    server = FileServer(tiny_shards, stall_s=0.05)  # slow enough that the ranks ask at the same time
    try:
        entries = read_manifest(tiny_shards)["splits"]["train"]["shards"][:3]
        caches = [ShardCache(HttpStore(server.url, FAST), tmp_path, policy=FAST) for _ in range(4)]
        paths = [[] for _ in caches]
        threads = [threading.Thread(target=lambda c=c, p=p: p.extend(c.fetch(e) for e in entries))
                   for c, p in zip(caches, paths)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [server.hits[e["name"]] for e in entries] == [1, 1, 1]
        assert sum(c.stats.downloads for c in caches) == 3 and sum(c.stats.hits for c in caches) == 9
        assert all(p == paths[0] for p in paths)
    finally:
        server.close()


def test_bounded_cache_evicts_least_recently_used_and_keeps_the_stream(servers, tiny_shards, tmp_path):
    _, _, http = servers
    entries = read_manifest(tiny_shards)["splits"]["train"]["shards"]
    bound = 2.5 * max(e["size"] for e in entries) / 2 ** 30  # room for two shards
    source = StreamSource(http.url, tmp_path, cache_gib=bound, policy=FAST)
    loader = ShardLoader(source, G, seed=5, order="blocks", block_shards=W, prefetch=0)
    batches = iter(loader)
    ids = []
    for _ in range(40):
        ids.append(next(batches)["row_id"].numpy())
        assert source.cache.used_bytes() <= bound * 2 ** 30
    assert source.cache.stats.evicted > 0
    assert np.array_equal(np.stack(ids), global_row_ids(lambda: str(tiny_shards), 1, steps=40))
    loader.close()


KILLED_DOWNLOAD = """
import sys
from data_prep.node_cache import ShardCache
from data_prep.stores import HttpStore, RetryPolicy
from data_prep.manifest import read_manifest
entry = read_manifest(sys.argv[1])["splits"]["train"]["shards"][0]
print("started", flush=True)
ShardCache(HttpStore(sys.argv[2], RetryPolicy()), sys.argv[3]).fetch(entry)
"""


def test_sigkill_during_a_download_leaves_no_cache_entry(tiny_shards, tmp_path):
    server = FileServer(tiny_shards, stall_s=30)
    proc = None
    try:
        proc = subprocess.Popen([sys.executable, "-c", KILLED_DOWNLOAD, str(tiny_shards), server.url,
                                 str(tmp_path)], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        assert proc.stdout.readline().strip() == "started"
        entry = read_manifest(tiny_shards)["splits"]["train"]["shards"][0]
        for _ in range(200):  # until half the body has arrived
            parts = list(tmp_path.rglob(f".*{entry['name']}.part-*"))
            if parts and parts[0].stat().st_size > 0:
                break
            time.sleep(0.05)
        assert parts, "the download never started"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not list(tmp_path.rglob(f"*{entry['name']}")), "a partial download is visible under the shard's name"
    finally:
        if proc is not None and proc.poll() is None:  # the test failed before the kill: leave no process behind
            proc.kill()
            proc.wait()
        server.close()
    fast = FileServer(tiny_shards)
    try:
        cache = ShardCache(HttpStore(fast.url, FAST), tmp_path, policy=FAST)
        assert not list(cache.dir.glob(".*.part-*"))  # the dead process's temporary file is gone
        path = cache.fetch(entry)
        assert path.read_bytes() == (Path(tiny_shards) / entry["name"]).read_bytes()
    finally:
        fast.close()


def test_resets_and_503s_on_a_fifth_of_requests_are_retried(tiny_shards, tmp_path):
    server = FileServer(tiny_shards, fail_rate=0.2, seed=3)
    try:
        ids = global_row_ids(lambda: StreamSource(server.url, tmp_path, policy=FAST), 2)
        assert server.failures > 0
        assert np.array_equal(ids, global_row_ids(lambda: str(tiny_shards), 1))
    finally:
        server.close()


def test_s3_connections_reset_on_a_fifth_of_requests_are_retried(servers, tiny_shards, tmp_path):
    s3, s3_url, _ = servers
    proxy = s3.fault_proxy(reset_rate=0.2, seed=4)
    ids = global_row_ids(lambda: StreamSource(s3_url, tmp_path, s3_endpoint=proxy.endpoint, policy=FAST), 2)
    assert proxy.resets > 0
    assert np.array_equal(ids, global_row_ids(lambda: str(tiny_shards), 1))


def test_missing_or_altered_object_is_one_clear_error_or_a_counted_skip(tiny_shards, tmp_path):
    first = global_row_ids(lambda: str(tiny_shards), 1, steps=1)[0]
    entries = read_manifest(tiny_shards)["splits"]["train"]["shards"]
    def shard_of(row):
        return next(e["name"] for e in entries if e["first_row"] <= row < e["first_row"] + e["rows"])

    bad, missing = shard_of(first[0]), shard_of(first[-1])
    assert bad != missing
    server = FileServer(tiny_shards, flip={bad})
    try:
        loader = ShardLoader(StreamSource(server.url, tmp_path / "a", policy=FAST), G, seed=5, order="blocks",
                             block_shards=W, prefetch=0)
        with pytest.raises(CorruptShardError, match=f"{bad}.*{server.url}/{bad}.*checksum mismatch"):
            next(iter(loader))
        assert not list((tmp_path / "a").rglob(f"*{bad}"))  # never visible in the cache
        server.flip, server.missing = set(), {missing}
        with pytest.raises(CorruptShardError, match=f"{missing}: missing from the store \\({server.url}/{missing}"):
            next(iter(ShardLoader(StreamSource(server.url, tmp_path / "b", policy=FAST), G, seed=5,
                                  order="blocks", block_shards=W, prefetch=0)))
        server.flip = {bad}
        skipping = [ShardLoader(StreamSource(server.url, tmp_path / "c", policy=FAST), G, rank, 2, seed=5,
                                order="blocks", block_shards=W, prefetch=0, on_corrupt="skip") for rank in range(2)]
        batches = [next(iter(loader)) for loader in skipping]
        ids = np.concatenate([b["row_id"].numpy() for b in batches])
        assert len(ids) == G and not set(ids) & {r for e in entries if e["name"] in (bad, missing)
                                                 for r in range(e["first_row"], e["first_row"] + e["rows"])}
        counted = {s["shard"] for loader in skipping for s in loader.skipped}
        assert counted == {bad, missing}
    finally:
        server.close()


def test_store_down_longer_than_the_retries_is_an_error_naming_the_url(tiny_shards, tmp_path):
    server = FileServer(tiny_shards)
    url = server.url
    server.down()
    with pytest.raises(StoreError, match=f"{url}/manifest.json: failed 3 times in a row.*Connection"):
        StreamSource(url, tmp_path, policy=RetryPolicy(attempts=3, backoff_s=0.01)).manifest()


def test_resume_at_step_20_under_another_dp_gives_the_same_rows_per_sample_index(servers, tiny_shards, tmp_path):
    _, _, http = servers

    def loaders(dp, cache):
        return [ShardLoader(StreamSource(http.url, tmp_path / cache, policy=FAST), G, rank, dp, seed=5,
                            order="blocks", block_shards=W, prefetch=2) for rank in range(dp)]

    straight = {}
    for loader in loaders(1, "straight"):
        batches = iter(loader)
        for _ in range(30):
            b = next(batches)
            straight.update(zip(b["sample_index"].tolist(), b["row_id"].tolist()))
        loader.close()
    first = loaders(2, "first")
    for loader in first:
        batches = iter(loader)
        for _ in range(20):
            next(batches)
    state = first[0].state_dict()
    assert state == first[1].state_dict() and state["step"] == 20
    for loader in first:
        loader.close()
    resumed = {}
    for loader in loaders(4, "resumed"):
        loader.load_state_dict(state)
        batches = iter(loader)
        for _ in range(10):
            b = next(batches)
            resumed.update(zip(b["sample_index"].tolist(), b["row_id"].tolist()))
        loader.close()
    assert sorted(resumed) == list(range(20 * G, 30 * G))
    assert resumed == {i: straight[i] for i in resumed}
    other = ShardLoader(str(tiny_shards), G, seed=5, order="blocks", block_shards=2)  # another order: refused
    with pytest.raises(ResumeStateError, match="dataset: saved '[^']*/blocks4', now '[^']*/blocks2'"):
        other.load_state_dict(state)


def s3_objects(s3, bucket: str, prefix: str) -> dict[str, bytes]:
    client = s3.client()
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix) + 1:]: client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read() for o in listed}


def test_upload_gives_the_same_bytes_and_an_interrupted_one_leaves_no_manifest(servers, tiny_shards, tmp_path,
                                                                                 monkeypatch):
    from data_prep.cli import main
    from data_prep.stores import LocalStore

    s3, _, _ = servers
    s3.client().create_bucket(Bucket="uploads")
    assert main(["upload", str(tiny_shards), "s3://uploads/done", "--s3-endpoint", s3.endpoint, "--quiet"]) == 0
    local = {p.relative_to(tiny_shards).as_posix(): p.read_bytes() for p in Path(tiny_shards).rglob("*")
             if p.is_file()}
    assert s3_objects(s3, "uploads", "done") == local

    # the order and the interruption are the store-independent part: shown on a directory target
    target = tmp_path / "target"
    order, real = [], LocalStore.upload

    def failing(self, path, name):
        order.append(name)
        if len(order) == 5:
            raise StoreError(self.object_url(name), "injected failure")
        real(self, path, name)

    assert main(["upload", str(tiny_shards), str(target), "--quiet"]) == 0
    monkeypatch.setattr(LocalStore, "upload", failing)
    assert main(["upload", str(tiny_shards), str(target), "--quiet"]) == 2
    assert not (target / "manifest.json").exists()  # the earlier upload's manifest is gone too
    order.clear()
    monkeypatch.setattr(LocalStore, "upload", lambda self, path, name: (order.append(name), real(self, path, name)))
    assert main(["upload", str(tiny_shards), str(target), "--quiet"]) == 0
    assert order[-1] == "manifest.json" and len(order) == len(local)
    assert {p.relative_to(target).as_posix(): p.read_bytes() for p in target.rglob("*") if p.is_file()} == local


def test_a_mix_of_corpora_gives_each_its_quota_per_batch_under_any_dp(servers, tiny_shards, tmp_path):
    from data_prep.mixture import mix_quotas

    assert mix_quotas([0.7, 0.3], 12).tolist() == [8, 4] and mix_quotas([1, 1, 1], 10).tolist() == [4, 3, 3]
    _, _, http = servers
    n = read_manifest(tiny_shards)["splits"]["train"]["rows"]

    def ids(dp, steps=30, start=None):
        out = []
        for rank in range(dp):
            corpora = [str(tiny_shards), StreamSource(http.url, tmp_path / f"mix{dp}-{rank}", policy=FAST)]
            loader = ShardLoader(corpora, G, rank, dp, seed=2, mix=[3, 1], order="blocks", block_shards=W,
                                 prefetch=0)
            if start is not None:
                loader.load_state_dict(start)
            batches = iter(loader)
            out.append([next(batches)["row_id"].numpy() for _ in range(steps)])
            state = loader.state_dict()
            loader.close()
        return np.stack([np.concatenate([o[s] for o in out]) for s in range(steps)]), state

    one, _ = ids(1)
    assert ((one < n).sum(axis=1) == 9).all()  # 3:1 of 12 rows, every batch
    for part in (one[one < n], one[one >= n] - n):  # each corpus: distinct rows (30 steps < an epoch of either)
        assert len(set(part.tolist())) == part.size
    two, _ = ids(2)
    assert np.array_equal(one, two)
    _, state = ids(2, steps=10)
    resumed, _ = ids(1, steps=20, start=state)
    assert np.array_equal(resumed, one[10:])


def test_inspect_reads_a_remote_shard_set_as_the_loader_does(tiny_shards, tmp_path):
    """`data_prep inspect URL` on a served shard set: the manifest, every shard fetched and checked, the tokenizer's
    hash and a sample row, exit 0; an altered shard is named BAD and the exit code is 1."""
    from data_prep.cli import main as data_prep_main

    server = FileServer(tiny_shards)
    try:
        assert data_prep_main(["inspect", server.url, "--quiet"]) == 0
    finally:
        server.down()
    names = sorted(p.name for p in tiny_shards.glob("*.tar"))
    server = FileServer(tiny_shards, flip={names[0]})
    try:
        assert data_prep_main(["inspect", server.url, "--quiet"]) == 1
    finally:
        server.down()


def test_a_transfer_damaged_on_the_way_is_fetched_again_not_skipped(tiny_shards, tmp_path):
    """One GET of a shard arrives altered (the store's copy is intact): the cache fetches it again, so under
    on_corrupt=skip no rank leaves out a shard the others read (the verdict is the store's bytes)."""
    entries = read_manifest(tiny_shards)["splits"]["train"]["shards"]
    server = FileServer(tiny_shards)
    try:
        server.flip_once = {e["name"]: True for e in entries}
        loader = ShardLoader(StreamSource(server.url, tmp_path / "a", policy=FAST), G, seed=5, order="blocks",
                             block_shards=W, prefetch=0, on_corrupt="skip")
        next(iter(loader))
        assert loader.skipped == [] and len(server.flip_once) < len(entries)  # some arrived altered, none skipped
    finally:
        server.close()


def test_a_damaged_cached_copy_is_fetched_again_not_skipped(tiny_shards, tmp_path):
    """A shard verified on download and later damaged in the node cache (a truncated file): under on_corrupt=skip the
    reader fetches it again instead of leaving it out on this rank alone, so the rows stay those every rank reads."""
    entries = read_manifest(tiny_shards)["splits"]["train"]["shards"]
    server = FileServer(tiny_shards)
    try:
        source = StreamSource(server.url, tmp_path / "cache", policy=FAST)
        for entry in entries:
            path = source.shard_path(entry)
        for cached in (tmp_path / "cache").rglob("*-train-*.tar"):
            with open(cached, "r+b") as f:
                f.truncate(cached.stat().st_size // 2)
        loader = ShardLoader(source, G, seed=5, order="blocks", block_shards=W, prefetch=0, on_corrupt="skip")
        next(iter(loader))
        assert loader.skipped == [] and path.exists()
        assert max(server.hits[e["name"]] for e in entries) == 2  # fetched once more after the damage
    finally:
        server.close()
