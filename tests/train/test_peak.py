"""The CPU peak: measured within ~2 s, once per machine (cached by CPU, ISA, threads, dtype, torch), by one process at
a time; MFU never above 100% (a peak below the achieved rate is re-measured once, then the figure is flagged)."""
from __future__ import annotations

import json
import math
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megaloop.train import peak as peak_mod
from megaloop.train.peak import Measurement, PeakCache, PeakGuard, cache_key, cpu_peak, measure_cpu_peak

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> PeakCache:
    monkeypatch.setenv("MEGALOOP_CACHE_DIR", str(tmp_path / "cache"))
    return PeakCache()


def fake_measure(values: list[float], calls: list):
    def measure(dtype, budget_s=None):
        calls.append(dtype)
        return Measurement(values[min(len(calls), len(values)) - 1], 256, 3, 0.01)
    return measure


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_measurement_is_short_and_positive(dtype):
    m = measure_cpu_peak(dtype)
    print(f"{dtype}: {m.tflops:.4f} TFLOP/s, {m.size}^2 matrices, {m.trials} trials in {m.seconds:.2f} s")
    assert m.tflops > 0 and m.trials >= 1 and m.size >= 64
    assert m.seconds < 4.0, "the design bound is ~2 s (1.2 s of trials after sizing); 4 s leaves room for a busy CPU"


def test_the_cache_is_read_instead_of_measuring(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(peak_mod, "measure_cpu_peak", fake_measure([0.5], calls))
    first = cpu_peak("fp32", cache=cache)
    second = cpu_peak("fp32", cache=cache)
    assert calls == [torch.float32] and first.tflops == second.tflops == 0.5
    assert "measured now" in first.source and first.measured_s > 0
    assert "cached in" in second.source and second.measured_s == 0.0
    entry = json.loads(cache.path.read_text())[cache_key("fp32")]
    assert entry["tflops"] == 0.5 and entry["matrix"] == 256


def test_the_key_separates_dtype_threads_and_isa(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    keys = {cache_key("fp32", 1), cache_key("bf16", 1), cache_key("fp32", 2)}
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    keys.add(cache_key("fp32", 1))
    assert len(keys) == 4 and all(torch.__version__ in k for k in keys)


def test_refresh_replaces_and_a_guard_remeasure_keeps_the_higher(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(peak_mod, "measure_cpu_peak", fake_measure([0.5, 0.2, 0.3], calls))
    cpu_peak("fp32", cache=cache)
    assert cpu_peak("fp32", refresh=True, cache=cache).tflops == 0.2  # `megaloop peak --refresh`: the new value
    kept = cpu_peak("fp32", refresh=True, keep_higher=True, cache=cache)
    assert kept.tflops == 0.3 and len(calls) == 3
    calls.clear()
    monkeypatch.setattr(peak_mod, "measure_cpu_peak", fake_measure([0.1], calls))
    kept = cpu_peak("fp32", refresh=True, keep_higher=True, cache=cache)
    assert kept.tflops == 0.3 and "kept the higher cached" in kept.source


def test_an_unwritable_cache_measures_in_process(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    calls = []
    monkeypatch.setattr(peak_mod, "measure_cpu_peak", fake_measure([0.4], calls))
    got = cpu_peak("fp32", cache=PeakCache(blocker / "cache"))
    assert got.tflops == 0.4 and "not cached" in got.source


def _measure_in_child(directory: str, log: str, out: str) -> None:
    def slow(dtype, budget_s=None):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(1.0)
        return Measurement(0.25, 128, 2, 1.0)

    peak_mod.measure_cpu_peak = slow
    Path(out).write_text(str(cpu_peak("fp32", cache=PeakCache(Path(directory))).tflops))


def test_processes_of_one_machine_measure_once(tmp_path):
    """Four processes start cold at once: one measures (under the lock), the other three read its result."""
    ctx = multiprocessing.get_context("fork")
    log = tmp_path / "measured.log"
    procs = [ctx.Process(target=_measure_in_child, args=(str(tmp_path / "c"), str(log), str(tmp_path / f"o{i}")))
             for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    assert len(log.read_text().split()) == 1
    assert {(tmp_path / f"o{i}").read_text() for i in range(4)} == {"0.25"}


def test_guard_remeasures_once_then_flags_instead_of_exceeding_100_percent(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(peak_mod, "measure_cpu_peak", fake_measure([1e-6, 2e-6], calls))
    guard = PeakGuard(CPU, "fp32", world_size=2)  # job peak 2 x 1e-6 TFLOP/s = 2e6 FLOP/s
    assert guard.utilisation(1e6, 1.5e6) == pytest.approx((0.5, 0.75))
    mfu, hfu = guard.utilisation(3e6, 3e6)  # above 2e6: re-measured to 2 x 2e-6 = 4e6
    assert calls == [torch.float32, torch.float32] and guard.remeasured
    assert (mfu, hfu) == pytest.approx((0.75, 0.75)) and "re-measured" in guard.peak.source
    mfu, hfu = guard.utilisation(5e6, 5e6)  # above again: flagged, not measured a third time
    assert math.isnan(mfu) and math.isnan(hfu) and guard.unreliable_steps == 1 and len(calls) == 2


def test_planted_low_peak_never_shows_above_100_percent(tiny_shards, tmp_path):
    """A cached peak far below what the CPU does (as if measured while the cores were busy): every MFU the run
    prints or logs is at most 100%, and the guard re-measured and raised the cached value."""
    env = run_env(tmp_path)
    key = subprocess.run([sys.executable, "-c", "from megaloop.train.peak import cache_key; print(cache_key('fp32'))"],
                         env=env, capture_output=True, text=True, check=True, cwd=REPO).stdout.strip()
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "cpu_peak.json").write_text(json.dumps({key: {"tflops": 1e-7}}))
    proc = start_tiny(tiny_shards, tmp_path, env)
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output[-3000:]
    assert_no_mfu_above_100(output, tmp_path / "run")
    cached = json.loads((tmp_path / "cache" / "cpu_peak.json").read_text())[key]["tflops"]
    assert cached > 1e-7, "the guard re-measured the peak and kept the higher value"


@pytest.mark.multiproc
def test_run_started_while_the_cores_are_saturated_never_shows_mfu_above_100(tiny_shards, tmp_path):
    """The peak is measured (cold cache) while 6 busy processes load the 2 cores; they stop once the run has
    printed its header, so the steps run faster than that peak allows."""
    env = run_env(tmp_path)
    hog = subprocess.Popen([sys.executable, "-c", "import multiprocessing as m\n"
                            "def spin():\n    while True: pass\n"
                            "ps = [m.Process(target=spin) for _ in range(6)]\n[p.start() for p in ps]\n"
                            "[p.join() for p in ps]"], start_new_session=True)
    try:
        time.sleep(1.0)
        proc = start_tiny(tiny_shards, tmp_path, env)
        header = proc.stdout.readline()
        while header and not header.startswith("megaloop: train "):
            header = proc.stdout.readline()
    finally:
        os.killpg(hog.pid, 9)
        hog.wait()
    output = header + proc.communicate(timeout=600)[0]
    print(header.strip())
    assert proc.returncode == 0, output[-3000:]
    assert "measured now" in header, "the peak was measured under the load"
    assert_no_mfu_above_100(output, tmp_path / "run")


def run_env(tmp_path: Path) -> dict:
    env = dict(os.environ, MEGALOOP_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    return env


def start_tiny(shards: Path, tmp_path: Path, env: dict, steps: int = 6) -> subprocess.Popen:
    """`megaloop train` of the tests' tiny fp32 model with its progress bar on, output merged into stdout."""
    from tests.train.conftest import TINY, fast_overrides

    sets = [o for o in fast_overrides(shards, tmp_path / "run", steps=steps) if not o.startswith("train.progress")]
    cmd = [sys.executable, "-m", "megaloop", "train", str(TINY), "--set", "train.progress=true"]
    cmd += [a for o in sets for a in ("--set", o)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def assert_no_mfu_above_100(output: str, run_dir: Path) -> None:
    import re

    shown = [float(x) for x in re.findall(r"MFU (\d+(?:\.\d+)?)%", output)]
    logged = [r[k] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "train" for k in ("mfu", "hfu")]
    print(f"MFU shown: {shown}; logged mfu/hfu: {[round(x, 4) for x in logged]}")
    assert shown and all(x <= 100.0 for x in shown), output[-3000:]
    assert all(math.isnan(x) or x <= 1.0 for x in logged)


def test_unreliable_mfu_advice_is_followed_and_mfu_comes_back(tiny_shards, tmp_path, monkeypatch, capsys):
    """A peak measured low every time (a machine busy at each measurement): the summary shows no MFU and proposes a
    command; run as printed, it re-measures the cached peak, and the next run shows MFU as a percentage."""
    import re
    import shlex

    from megaloop.config import load_config
    from megaloop.train.cli import run_training
    from tests.train.conftest import TINY, fast_overrides

    monkeypatch.setenv("MEGALOOP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(peak_mod, "measure_cpu_peak", lambda dtype, budget_s=None: Measurement(1e-9, 64, 1, 0.01))
    assert run_training(load_config(TINY, fast_overrides(tiny_shards, tmp_path / "busy", steps=3))) == 0
    summary = capsys.readouterr().out
    line = next(x for x in summary.splitlines() if x.startswith("MFU"))
    command = re.search(r"re-measure it on an idle machine: (python -m megaloop peak [^)]+)\)", line).group(1)
    monkeypatch.undo()
    env = dict(os.environ, MEGALOOP_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    monkeypatch.setenv("MEGALOOP_CACHE_DIR", str(tmp_path / "cache"))
    assert run_training(load_config(TINY, fast_overrides(tiny_shards, tmp_path / "idle", steps=3))) == 0
    after = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("MFU"))
    with capsys.disabled():
        print(f"\nbusy: {line}\nran: {command}\nthen: {after}")
    assert re.fullmatch(r"MFU \(useful/peak\)\s+\d+\.\d%", after)


def test_a_peak_slower_than_a_wider_precisions_is_not_a_peak(cache, monkeypatch):
    """The CPU emulates FP8 (and bf16 without AVX512-BF16): MFU against FP8 divides by the best of FP8, bf16 and fp32
    (here bf16's), so a run that beats the emulated FP8 rate cannot show MFU above 100%."""
    rates = {torch.float8_e4m3fn: 0.02, torch.bfloat16: 0.2, torch.float32: 0.1, torch.float64: 0.05}
    monkeypatch.setattr(peak_mod, "measure_cpu_peak", lambda dtype, budget_s=None: Measurement(rates[dtype], 256, 3,
                                                                                              0.01))
    assert peak_mod.best_cpu_peak("fp8").tflops == 0.2 and "faster here than the fp8" in \
        peak_mod.best_cpu_peak("fp8").source
    assert peak_mod.best_cpu_peak("bf16").tflops == 0.2 and peak_mod.best_cpu_peak("fp32").tflops == 0.1
    assert peak_mod.best_cpu_peak("fp64").tflops == 0.05  # nothing wider to stand in
    rates[torch.bfloat16] = 0.05  # emulated bf16: fp32 is the peak of a bf16 run
    monkeypatch.setenv("MEGALOOP_CACHE_DIR", str(cache.dir / "second"))
    assert peak_mod.best_cpu_peak("bf16").tflops == 0.1


@pytest.mark.parametrize("processes,threads,cores,share", [(1, 1, 2, 1.0), (2, 1, 2, 1.0), (4, 1, 2, 0.5),
                                                           (2, 2, 2, 0.5), (64, 1, 2, 2 / 64)])
def test_the_peak_counts_the_cores_the_processes_share(processes, threads, cores, share):
    assert peak_mod.core_share(processes, threads, cores) == pytest.approx(share)
    warning = peak_mod.oversubscription_warning(processes, threads, cores)
    assert (warning is None) == (share == 1.0)
    if warning:
        assert f"{processes} process(es) x {threads} thread(s) on {cores} available core(s)" in warning


def test_bench_peaks_use_the_best_precision_and_the_core_share(cache, monkeypatch):
    """bench's MFU peaks, the figures it divides by: FP8 against bf16's rate where that is faster, and 4 one-thread
    processes on 2 cores count 2 cores (job peak = one process's x 4 x 0.5)."""
    from megaloop.train.bench import job_peaks

    rates = {torch.float8_e4m3fn: 0.02, torch.bfloat16: 0.2, torch.float32: 0.1}
    monkeypatch.setattr(peak_mod, "measure_cpu_peak", lambda dtype, budget_s=None: Measurement(rates[dtype], 256, 3,
                                                                                              0.01))
    monkeypatch.setattr(peak_mod, "available_cores", lambda: 2)
    peaks, sources = job_peaks("cpu", "bf16", world=4, threads=1)
    assert peaks == pytest.approx({"bf16 dense": 0.2 * 4 * 0.5, "FP8 dense": 0.2 * 4 * 0.5})
    assert "share the cores" in sources["FP8 dense"]


def test_megaloop_peak_lists_fp8(cache):
    out = subprocess.run([sys.executable, "-m", "megaloop", "peak", "--json"], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "MEGALOOP_CACHE_DIR": str(cache.dir)}, timeout=300, check=True)
    peaks = json.loads(out.stdout)["peaks_tflops"]
    assert set(peaks) == {"fp32", "bf16", "fp8", "fp64"} and peaks["fp8"] >= peaks["bf16"] >= 0
