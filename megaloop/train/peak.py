"""The peak TFLOP/s that MFU divides by: NVIDIA's dense figures for known GPUs, a cached measurement on CPU.

A CPU has no published peak, so it is measured: square matmuls in the run's dtype on the process's threads, the best
of repeated short trials (at most ~2 s in all; the matrix grows until one product takes ~20 ms, so a dtype that the
CPU emulates, bf16 without AVX512-BF16, gets a small one). It is measured once per machine: the result is cached
under ~/.cache/megaloop/cpu_peak.json (XDG_CACHE_HOME, or MEGALOOP_CACHE_DIR, moves it), keyed by CPU model,
instruction sets, thread count, dtype and torch version, so training processes start without measuring. A file lock
makes the processes of one node measure one at a time (one measures, the others read its result), so they do not
slow each other's trial down. `python -m megaloop peak [--refresh]` shows and re-measures the cache.

A peak measured while other work shared the cores is too low, and MFU above 100% would follow: `PeakGuard` watches
each step's achieved rate, re-measures once when it exceeds the peak (keeping the higher value), and reports the
figure as unreliable (NaN, never a number above 100%) if it still does.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Dense peaks in TFLOP/s (NVIDIA's sparsity figures halved; fp32: the non-tensor-core rate, torch's default matmul
# precision "highest"). Keys are the words of a device name: "H100" is the SXM part, the PCIe and NVL parts have their
# own rows, and a device name matches the longest key all of whose words it contains (device_peak).
PEAK_TFLOPS = {
    ("H100", "bf16"): 989.4, ("H100", "fp8"): 1978.9, ("H100", "fp32"): 66.9,
    ("H100 PCIe", "bf16"): 756.5, ("H100 PCIe", "fp8"): 1513.0, ("H100 PCIe", "fp32"): 51.2,
    ("H100 NVL", "bf16"): 835.5, ("H100 NVL", "fp8"): 1670.5, ("H100 NVL", "fp32"): 60.0,
    ("H200", "bf16"): 989.4, ("H200", "fp8"): 1978.9, ("H200", "fp32"): 66.9,
    ("H200 NVL", "bf16"): 835.5, ("H200 NVL", "fp8"): 1670.5, ("H200 NVL", "fp32"): 60.0,
    ("A100", "bf16"): 312.0, ("A100", "fp32"): 19.5,
}
CPU_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64, "fp8": torch.float8_e4m3fn}
TRIAL_SECONDS = 0.02  # the matrix grows until one product takes this long (or MAX_SIZE)
MAX_SIZE = 2048
BUDGET_SECONDS = 1.2  # the trials' total, after the sizing


@dataclass(frozen=True)
class Measurement:
    tflops: float
    size: int
    trials: int
    seconds: float


def measure_cpu_peak(dtype: torch.dtype, budget_s: float = BUDGET_SECONDS) -> Measurement:
    """The best TFLOP/s of square `dtype` matmuls on this process's threads within about budget_s seconds."""
    t_start = time.perf_counter()
    size, dt = 64, 0.0
    while True:
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        product = _product(a, b)
        product()  # warm the kernel for this shape
        t0 = time.perf_counter()
        product()
        dt = time.perf_counter() - t0
        if dt >= TRIAL_SECONDS or size >= MAX_SIZE:
            break
        size *= 2
    best, trials, t_end = 2 * size ** 3 / dt, 1, time.perf_counter() + budget_s
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        product()
        best = max(best, 2 * size ** 3 / (time.perf_counter() - t0))
        trials += 1
    return Measurement(best / 1e12, size, trials, time.perf_counter() - t_start)


def _product(a: torch.Tensor, b: torch.Tensor):
    """a @ b as a training GEMM of that dtype runs it: float8 through torch._scaled_mm (per-tensor scales, bf16
    out), the others as plain matmuls."""
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        one, bt = torch.tensor(1.0), b.t().contiguous().t()  # _scaled_mm wants its second operand column-major
        return lambda: torch._scaled_mm(a, bt, one, one, out_dtype=torch.bfloat16)
    return lambda: a @ b


def cache_dir() -> Path:
    if os.environ.get("MEGALOOP_CACHE_DIR"):
        return Path(os.environ["MEGALOOP_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megaloop"


def cache_key(precision: str, threads: int | None = None) -> str:
    from megaloop.train.hardware import cpu_isa, cpu_name

    threads = threads or torch.get_num_threads()
    return f"{cpu_name()} | {cpu_isa()} | {threads} threads | {precision} | " \
           f"torch {torch.__version__}"


class PeakCache:
    """The per-machine JSON file of measured CPU peaks; read and written under an exclusive lock."""

    def __init__(self, directory: Path | None = None):
        self.dir = Path(directory) if directory is not None else cache_dir()
        self.path = self.dir / "cpu_peak.json"

    @contextlib.contextmanager
    def locked(self):
        """Hold the cache's lock (one measuring process per machine at a time); without a writable cache
        directory, nothing is locked or stored and peaks are measured in-process."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            handle = open(self.dir / "cpu_peak.lock", "a")
        except OSError:
            yield False
            return
        with handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield True
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def entries(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}  # none yet, or unreadable: measured again and rewritten
        return data if isinstance(data, dict) else {}

    def store(self, key: str, m: Measurement, keep_higher: bool) -> float:
        """Record `m` under `key` (the higher of it and the cached value if keep_higher); returns the value kept."""
        entries = self.entries()
        old = entries.get(key, {}).get("tflops", 0.0)
        if keep_higher and old >= m.tflops:
            return old
        entries[key] = {"tflops": m.tflops, "matrix": m.size, "trials": m.trials, "seconds": round(m.seconds, 3),
                        "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        tmp.replace(self.path)
        return m.tflops


@dataclass(frozen=True)
class Peak:
    """A peak in TFLOP/s and where it came from (for the run header and the summary)."""

    tflops: float
    source: str
    measured_s: float = 0.0  # time spent measuring now (0 from the table or the cache)


def cpu_peak(precision: str, refresh: bool = False, keep_higher: bool = False, cache: PeakCache | None = None) -> Peak:
    """The CPU peak for `precision` on this process's threads: the cached value, or measured (and cached) when there
    is none or `refresh` is set (keep_higher: a re-measurement never lowers the cached value)."""
    cache = cache or PeakCache()
    key = cache_key(precision)
    with cache.locked() as writable:
        hit = None if refresh else cache.entries().get(key)
        if hit and hit.get("tflops", 0) > 0:
            return Peak(hit["tflops"], f"CPU {precision} matmul measured {hit.get('measured', '?')}, cached in "
                                       f"{cache.path}")
        m = measure_cpu_peak(CPU_DTYPES[precision])
        if not writable:
            return Peak(m.tflops, f"CPU {precision} matmul measured now in {m.seconds:.1f} s (not cached: "
                                  f"{cache.dir} is not writable)", m.seconds)
        value = cache.store(key, m, keep_higher)
        kept = "" if value == m.tflops else f"; kept the higher cached {value:.4f}"
        return Peak(value, f"CPU {precision} matmul measured now in {m.seconds:.1f} s ({m.tflops:.4f}{kept}), "
                           f"cached in {cache.path}", m.seconds)


# a GEMM asked for in one precision can always run in a wider one (FP8 work in bf16, bf16 work in fp32)
WIDTHS = {"fp8": 8, "bf16": 16, "fp32": 32, "fp64": 64}


def best_peak(precision: str, peaks: dict[str, Peak]) -> Peak:
    """The peak a run in `precision` is measured against: the best of `peaks` (precision -> Peak) over `precision`
    and every wider one. A measured "peak" slower than a wider precision's is not a peak (the CPU emulates FP8, and
    bf16 without AVX512-BF16): the run could have used the faster one, so MFU above 100% cannot follow."""
    own = peaks[precision]
    wider = [p for p in WIDTHS if WIDTHS[p] > WIDTHS[precision] and p in peaks]
    best = max(wider, key=lambda p: peaks[p].tflops if math.isfinite(peaks[p].tflops) else -1.0, default=None)
    if best is None or not peaks[best].tflops > own.tflops:
        return own
    return Peak(peaks[best].tflops, f"{best} matmul, faster here than the {precision} one measured "
                                    f"({own.tflops:.4g} TFLOP/s); {peaks[best].source}",
                own.measured_s + peaks[best].measured_s)


def best_cpu_peak(precision: str) -> Peak:
    """best_peak over the CPU measurements of `precision` and the wider precisions up to fp32 (fp64 is never faster;
    an fp64 run has only its own)."""
    names = [p for p in ("fp8", "bf16", "fp32") if WIDTHS[p] >= WIDTHS[precision]] or [precision]
    return best_peak(precision, {p: cpu_peak(p) for p in names})


def available_cores() -> int:
    """The cores this process may run on (its affinity mask: a Slurm or container limit, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def local_processes() -> int:
    """The training processes on this node (torchrun's LOCAL_WORLD_SIZE, Slurm's SLURM_NTASKS_PER_NODE, else 1)."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def core_share(processes: int, threads: int, cores: int | None = None) -> float:
    """The fraction of a one-process peak each of `processes` x `threads` CPU threads can get: 1 when they fit in
    the available cores, cores / (processes x threads) when they oversubscribe them (4 one-thread processes on 2
    cores share 2 cores' worth of peak, not 4)."""
    cores = available_cores() if cores is None else cores
    return min(1.0, cores / max(1, processes * threads))


def oversubscription_warning(processes: int, threads: int, cores: int | None = None) -> str | None:
    """One line when processes x threads exceed the available cores (None otherwise)."""
    cores = available_cores() if cores is None else cores
    if processes * threads <= cores:
        return None
    fix = (f"OMP_NUM_THREADS={cores // processes}" if threads > 1 and cores >= processes
           else f"at most {cores} process(es) with OMP_NUM_THREADS=1")
    return (f"{processes} process(es) x {threads} thread(s) on {cores} available core(s): they share the cores, "
            f"so the peak counts {cores} core(s) and the steps run slower than they would with {fix}")


def gpu_peak(name: str, precision: str) -> Peak:
    """The table's dense peak for a device name as torch reports it ("NVIDIA H100 PCIe", "NVIDIA H200 NVL",
    "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"): the longest key all of whose words are words of the name
(case-insensitive; "GH200" is not "H200")."""
    words = name.lower().replace("-", " ").split()
    for gpu in sorted({g for g, _ in PEAK_TFLOPS}, key=len, reverse=True):
        if all(part.lower() in words for part in gpu.split()):
            value = PEAK_TFLOPS.get((gpu, precision))
            if value is None:
                return Peak(float("nan"), f"no {precision} peak in the table for {name!r} ({gpu})")
            return Peak(value, f"table ({gpu} {precision} dense)")
    return Peak(float("nan"), f"no peak known for {name!r} {precision}")


def device_peak(device: torch.device, precision: str) -> Peak:
    """The peak of one process's device for MFU: the table for known GPUs, the cached measurement on CPU."""
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), precision)
    return best_cpu_peak(precision)


class PeakGuard:
    """Keeps MFU honest: the job's peak (one process's times world_size), re-measured once on CPU when a step's
    achieved rate exceeds it; a rate still above the peak makes that step's MFU unreliable (NaN)."""

    def __init__(self, device: torch.device, precision: str, world_size: int, share: float = 1.0):
        self.device, self.precision, self.world_size = device, precision, world_size
        self.share = share  # core_share on CPU: the processes x threads that fit in the available cores
        self.peak = device_peak(device, precision)
        self.remeasured = False
        self.unreliable_steps = 0

    @property
    def job_tflops(self) -> float:
        return self.peak.tflops * self.world_size * self.share

    def utilisation(self, useful_per_s: float, executed_per_s: float) -> tuple[float, float]:
        """(MFU, HFU): useful and executed FLOP/s over the job's peak; both NaN when the peak is unknown or below
        the executed rate (after one re-measurement on CPU)."""
        peak = self.job_tflops * 1e12
        if not math.isfinite(peak):
            return float("nan"), float("nan")
        if executed_per_s > peak and self.device.type == "cpu" and not self.remeasured:
            self.remeasured = True
            cpu_peak(self.precision, refresh=True, keep_higher=True)
            fresh = best_cpu_peak(self.precision)
            self.peak = Peak(fresh.tflops, fresh.source + " (re-measured: a step ran faster than the peak found "
                                                          "first)", fresh.measured_s)
            peak = self.job_tflops * 1e12
        if executed_per_s > peak:
            self.unreliable_steps += 1
            return float("nan"), float("nan")
        return useful_per_s / peak, executed_per_s / peak
