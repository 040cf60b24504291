"""ByteStore.size: a remote input's size without reading it, the same from a directory, HTTP (HEAD) and S3."""
from __future__ import annotations

import pytest

from data_prep.local_servers import FileServer, S3Server
from data_prep.stores import RetryPolicy, StoreError, open_store


def test_size_agrees_with_the_file_on_every_store(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.parquet").write_bytes(b"x" * 1234)
    policy = RetryPolicy(attempts=1)
    http = FileServer(tmp_path)
    s3 = S3Server()
    try:
        stores = [open_store(str(tmp_path)), open_store(http.url, policy),
                  open_store(s3.put_dir(tmp_path, "bucket", "pre"), policy, s3_endpoint=s3.endpoint)]
        for store in stores:
            assert store.size("sub/a.parquet") == 1234
            with pytest.raises(StoreError) as err:
                store.size("sub/missing.parquet")
            assert err.value.missing
        assert http.hits["sub/a.parquet"] == 0  # HEAD only: no body was sent
    finally:
        http.close()
        s3.close()
