"""The CPU-side logic of the GPU FP8 checks: benchmarks/fp8_curves.py's run names and its bound (FP8 vs bf16 final
losses, the comparison scripts/gpu_check.sh prints for parcae-140m), and scripts/gpu_bench.sh's throughput matrix
(bf16, torchao FP8, TE FP8 where it imports; eager and compiled), run with a stand-in interpreter that records the
commands it is given."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.fp8_curves import main, report, run_overrides

REPO = Path(__file__).resolve().parents[2]


def _summary(losses, val):
    return SimpleNamespace(losses=losses, val={t: {"val_loss": v} for t, v in val.items()})


def test_fp8_curves_runs_and_bound(capsys):
    assert run_overrides("none") == ["train.fp8=none"]
    assert run_overrides("te") == ["train.fp8=tensorwise", "train.fp8_backend=te"]
    with pytest.raises(ValueError, match="use one of"):
        run_overrides("delayed")
    base = _summary([6.0] * 8 + [5.0] * 2, {1: 5.0, 4: 4.8})
    close = _summary([6.0] * 8 + [5.04] * 2, {1: 5.04, 4: 4.83})  # +0.8%, +0.6%
    far_val = _summary([6.0] * 8 + [5.0] * 2, {1: 5.0, 4: 4.9})  # +2.1% at T=4
    far_train = _summary([6.0] * 8 + [5.1] * 2, {1: 5.0, 4: 4.8})  # +2.0% (tail 2)
    assert report({"none": base, "tensorwise": close}, width=5, tail=2, tol=0.015)
    assert not report({"none": base, "tensorwise": close, "te": far_val}, width=5, tail=2, tol=0.015)
    assert not report({"none": base, "rowwise": far_train}, width=5, tail=2, tol=0.015)
    assert report({"none": base, "rowwise": far_train}, width=5, tail=8, tol=0.015)  # the tail is what is compared
    printed = capsys.readouterr().out
    assert "fp8 te" in printed and "(+2.08%)" in printed and "within 1.5% of bf16's: False" in printed
    with pytest.raises(ValueError, match="bf16 run"):
        report({"tensorwise": close}, width=5)
    for argv in (["--runs", "tensorwise"], ["--runs", "none", "--tail", "0"], ["--run", "delayed"]):
        with pytest.raises(SystemExit) as err:
            main(argv)
        assert err.value.code == 2


def _fake_python(tmp_path: Path, te: bool) -> tuple[Path, Path]:
    log = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n"
                    f"echo \"$*\" >> {log}\n"
                    f"case \"$*\" in *transformer_engine*) exit {0 if te else 1};; esac\n"
                    "exit 0\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return fake, log


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="runs bash scripts")
@pytest.mark.parametrize("te", [True, False])
def test_gpu_bench_matrix(tmp_path, te):
    fake, log = _fake_python(tmp_path, te)
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "manifest.json").write_text("{}")
    env = {**os.environ, "PYTHON": str(fake), "SHARDS": str(shards), "STEPS": "3"}
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_bench.sh")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    benches = [line.split() for line in log.read_text().splitlines() if line.startswith("-m megaloop bench")]
    settings = [{a for a in b if "=" in a and not a.startswith("data.shards")} for b in benches]
    variants = [set(), {"train.fp8=tensorwise"}] + ([{"train.fp8=tensorwise", "train.fp8_backend=te"}] if te else [])
    want = [v | {f"train.compile={c}", "model.attention=auto"} for c in ("false", "true") for v in variants]
    want.append({"train.compile=false", "model.attention=sdpa"})
    common = {"train.device=cuda", "train.precision=bf16", "train.progress=false", "data.global_batch_size=16",
              "data.micro_batch_size=8"}
    assert [s - common for s in settings] == want and all(common <= s for s in settings)
    assert all(b[b.index("--steps") + 1] == "3" and "configs/parcae-770m.yaml" in b for b in benches)
    assert ("TE FP8: skipped" in done.stdout) != te


def test_gpu_scripts_parse():
    for script in ("gpu_check.sh", "gpu_bench.sh"):
        subprocess.run(["bash", "-n", str(REPO / "scripts" / script)], check=True)
