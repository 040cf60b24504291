"""Upload a shard directory to a store (s3://bucket/prefix, or another directory), the manifest last.

A reader starts from the manifest (data_prep.sources), so a dataset becomes visible only when every shard and the
tokenizer copy are in place: the manifest already at the URL (an earlier upload) is deleted first, every other file
is uploaded (with retries, data_prep.stores), and manifest.json goes up last. An upload that is interrupted
therefore leaves no manifest, and running it again completes it.
"""
from __future__ import annotations

from pathlib import Path

from .errors import DataPrepError
from .manifest import MANIFEST_FILE, read_manifest, verify_shards
from .stores import RetryPolicy, StoreError, open_store, retrying


def dataset_files(local_dir: Path) -> list[Path]:
    """Every file of the shard directory except the manifest, in a fixed order."""
    return sorted(p for p in local_dir.rglob("*") if p.is_file() and p.relative_to(local_dir).as_posix()
                  != MANIFEST_FILE)


def upload(local_dir, url: str, s3_endpoint: str | None = None, policy: RetryPolicy | None = None,
           progress: bool = True) -> dict:
    """Upload `local_dir` (a complete shard directory) to `url`; returns {"files", "bytes"}."""
    from tqdm import tqdm

    local_dir, policy = Path(local_dir), policy or RetryPolicy()
    manifest = read_manifest(local_dir)  # a complete directory only
    problems = verify_shards(local_dir, manifest, "fast")
    if problems:
        name, problem = next(iter(problems.items()))
        raise DataPrepError(f"{local_dir}/{name}: {problem}", "re-create the shards before uploading them")
    store = open_store(url, policy, s3_endpoint)
    retrying(lambda: store.delete(MANIFEST_FILE), store.object_url(MANIFEST_FILE), policy)
    files = dataset_files(local_dir)
    total = sum(p.stat().st_size for p in files) + (local_dir / MANIFEST_FILE).stat().st_size
    with tqdm(total=total, unit="B", unit_scale=True, desc="upload", disable=not progress) as bar:
        for path in [*files, local_dir / MANIFEST_FILE]:
            name = path.relative_to(local_dir).as_posix()
            retrying(lambda: store.upload(path, name), store.object_url(name), policy)
            bar.update(path.stat().st_size)
    return {"files": len(files) + 1, "bytes": total}


def upload_after_prepare(local_dir, url: str, comm=None, s3_endpoint: str | None = None,
                         progress: bool = True) -> dict | None:
    """`shards --out URL`: rank 0 (which wrote the shards) uploads them; the other MPI ranks wait for it and share
    its outcome, so that every rank exits with the same status."""
    rank = comm.Get_rank() if comm is not None else 0
    outcome, error = None, None
    if rank == 0:
        try:
            outcome = upload(local_dir, url, s3_endpoint, progress=progress)
        except (DataPrepError, StoreError) as err:
            error = err
    if comm is not None:
        failed = comm.bcast(None if error is None else str(error), root=0)
        if failed is not None and rank != 0:
            err = DataPrepError(failed)
            err.collective = True
            raise err
    if error is not None:
        error.collective = True
        raise error
    return outcome
