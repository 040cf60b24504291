"""`data_prep shards --out s3://...` under 2 MPI ranks against a local run, and an interrupted upload.

Builds the chapters corpus and tokenizer, writes shards locally with one process, then with `mpirun -n 2 python -m
data_prep shards ... --out s3://corpus/mpi` (moto's S3 server on 127.0.0.1); downloads every object under the
prefix and compares it byte for byte with the local run's files. Then uploads the local directory with `python -m
data_prep upload` through a proxy that resets half of the connections and --retries 1, so that it fails part-way:
it must exit non-zero and leave no manifest.json at the URL (a reader refuses the prefix), and a plain re-run must
complete it.

    python benchmarks/stream_upload.py [--files 24]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from stream_common import REPO, build_shards

from data_prep.local_servers import S3Server


def objects(s3, bucket: str, prefix: str) -> dict[str, bytes]:
    client, found, token = s3.client(), {}, None
    while True:
        page = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/",
                                      **({"ContinuationToken": token} if token else {}))
        for o in page.get("Contents", []):
            found[o["Key"][len(prefix) + 1:]] = client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
        token = page.get("NextContinuationToken")
        if not token:
            return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=24)
    args = p.parse_args(argv)
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("error: mpirun not found (apt-get install openmpi-bin libopenmpi-dev)")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        local = build_shards(tmp / "data", files=args.files)
        s3 = S3Server()
        s3.client().create_bucket(Bucket="corpus")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        shards_args = ["--input", str(tmp / "data" / "corpus"), "--tokenizer", str(tmp / "data" / "tok"),
                       "--seq-len", "32", "--shard-size", "256", "--val-fraction", "0.1", "--quiet"]
        done = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, "-m",
                               "data_prep", "shards", *shards_args, "--output", str(tmp / "mpi"),
                               "--out", "s3://corpus/mpi", "--s3-endpoint", s3.endpoint],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        print(f"mpirun -n 2 data_prep shards --out s3://corpus/mpi: exit {done.returncode}; "
              f"{done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]}")
        uploaded = objects(s3, "corpus", "mpi")
        files = {p.relative_to(local).as_posix(): p.read_bytes() for p in local.rglob("*") if p.is_file()}
        same = uploaded == files
        print(f"  {len(uploaded)} objects downloaded, {sum(map(len, uploaded.values())) / 1e6:.2f} MB; byte-identical "
              f"to the single-process local run's {len(files)} files: {same}")
        ok &= done.returncode == 0 and same

        proxy = s3.fault_proxy(reset_rate=0.5, seed=2)
        cut = subprocess.run([sys.executable, "-m", "data_prep", "upload", str(local), "s3://corpus/cut",
                              "--s3-endpoint", proxy.endpoint, "--retries", "1", "--quiet"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        left = objects(s3, "corpus", "cut")
        print(f"upload through a proxy resetting half the connections, --retries 1: exit {cut.returncode}, "
              f"{len(left)} of {len(files)} objects there, manifest.json there: {'manifest.json' in left}; "
              f"error: {cut.stderr.strip().splitlines()[-1][:200] if cut.stderr.strip() else '-'}")
        ok &= cut.returncode != 0 and "manifest.json" not in left
        again = subprocess.run([sys.executable, "-m", "data_prep", "upload", str(local), "s3://corpus/cut",
                                "--s3-endpoint", s3.endpoint, "--quiet"], cwd=REPO, env=env, capture_output=True,
                               text=True, timeout=600)
        complete = objects(s3, "corpus", "cut") == files
        print(f"re-run without faults: exit {again.returncode}, complete and byte-identical: {complete}")
        ok &= again.returncode == 0 and complete
        s3.close()
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
