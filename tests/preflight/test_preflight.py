"""`python -m megaloop preflight` on CPU (gloo): every path passes on 4 processes, and a perturbed path fails with
exit code 3 (MEGALOOP_PREFLIGHT_FAULT perturbs that path's distributed run, so its comparison must catch it)."""
from __future__ import annotations

import json
import os
import sys

import pytest

from megaloop.preflight.worker import FAILED_EXIT_CODE, PATHS
from tests.process_group import run_group

pytestmark = pytest.mark.multiproc


def preflight(*args: str, fault: str | None = None, timeout: float = 600):
    env = {k: v for k, v in os.environ.items() if k != "MEGALOOP_PREFLIGHT_FAULT"}
    env["OMP_NUM_THREADS"] = "1"
    if fault:
        env["MEGALOOP_PREFLIGHT_FAULT"] = fault
    done = run_group([sys.executable, "-m", "megaloop", "preflight", "--json", *args], timeout=timeout, env=env,
                     capture_output=True, text=True)
    found = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done, (found[-1] if found else None)


def test_every_path_passes_on_four_cpu_processes():
    done, report = preflight("--nproc-per-node", "4")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["ok"] and report["world"] == {"processes": 4, "nodes": 1, "backend": "gloo", "device": "cpu"}
    assert [p["name"] for p in report["paths"]] == list(PATHS)
    for path in report["paths"]:
        assert path["status"] == "PASS" and path["busbw_gbs"] > 0 and path["link"] == "loopback", path
    details = {p["name"]: p["detail"] for p in report["paths"]}
    assert "bit-identical" in details["checkpoint_dp"] and "25.2 MB messages" in details["pp2_1p3b_messages"]
    lines = done.stdout.splitlines()
    assert [line.split(" in ")[0] for line in lines if line.startswith("[") and "running" not in line] == [
        f"[{i}/6] {n}: PASS" for i, n in enumerate(PATHS, 1)]
    assert "preflight: 6/6 paths passed" in lines


def test_a_perturbed_path_fails_with_exit_code_3():
    done, report = preflight("--nproc-per-node", "2", "--only", "zero1,dist_muon", fault="zero1")
    assert done.returncode == FAILED_EXIT_CODE, done.stdout[-3000:] + done.stderr[-3000:]
    assert {p["name"]: p["status"] for p in report["paths"]} == {"zero1": "FAIL", "dist_muon": "PASS"}
    assert "wrong elements" in report["paths"][0]["detail"]
    assert "megaloop preflight: FAILED" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("args, key", [(["--nproc-per-node", "3"], "--nproc-per-node"), (["--only", "tp4"], "--only"),
                                       (["--min-bw-fraction", "2"], "--min-bw-fraction")])
def test_bad_options_are_one_line(args, key, capsys):
    from megaloop.__main__ import main

    assert main(["preflight", *args]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and key in err


def test_more_local_workers_than_the_machine_holds_are_refused_before_any_start(monkeypatch, capsys):
    """64 workers on 2 cores and 23 GB: one line, exit 2, a size that fits, and nothing started."""
    import megaloop.preflight.cli as cli
    import megaloop.train.peak as peak
    from megaloop.__main__ import main

    monkeypatch.setattr(peak, "available_cores", lambda: 2)
    monkeypatch.setattr(cli, "available_memory_gb", lambda: 23.0)
    monkeypatch.setattr(cli, "_launch", lambda *a: pytest.fail("workers were started"))
    assert main(["preflight", "--nproc-per-node", "64", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "64 CPU workers need about 64 GB" in err
    assert "use --nproc-per-node 4 or fewer" in err


@pytest.mark.parametrize("nproc, cores, memory, fits", [(4, 2, 23.0, True), (6, 2, 23.0, False),
                                                        (10, 64, 10.5, True), (12, 64, 10.5, False)])
def test_the_fit_counts_cores_and_memory(nproc, cores, memory, fits):
    from megaloop.config import ConfigError
    from megaloop.preflight.cli import check_local_fit

    if fits:
        check_local_fit(nproc, cores, memory)
    else:
        with pytest.raises(ConfigError, match=f"use --nproc-per-node {min(2 * cores, int(memory)) // 2 * 2} or"):
            check_local_fit(nproc, cores, memory)


@pytest.mark.parametrize("keep", [False, True])
def test_the_work_folder_goes_on_every_exit(monkeypatch, tmp_path, keep):
    """A run that dies (here: its workers' agent raising) leaves no work folder in the temporary directory, unless
    --keep asked for it."""
    import tempfile

    import megaloop.preflight.cli as cli
    from megaloop.__main__ import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []

    def dying(args, nproc):
        seen.append(args.work_dir)
        (tmp_path / os.path.basename(args.work_dir) / "data").mkdir()
        raise SystemExit(1)

    monkeypatch.setattr(cli, "_launch", dying)
    with pytest.raises(SystemExit):
        main(["preflight", "--nproc-per-node", "2", "--device", "cpu", *(["--keep"] if keep else [])])
    assert seen and os.path.dirname(seen[0]) == str(tmp_path)
    assert os.path.isdir(seen[0]) == keep
