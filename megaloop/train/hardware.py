"""What this machine computes fast: native bf16 matmuls on the CPU or GPU, and a name for the CPU.

A CPU without AVX512-BF16 or AMX runs bf16 matmuls in emulation: on an AVX2-only CPU they are tens of times slower
than fp32 (benchmarks/precision_speed.py measures the ratio), so `train.precision: auto` must not pick bf16 there.
torch's CPU bf16 matmuls go through oneDNN, which honours ONEDNN_MAX_CPU_ISA (alias DNNL_MAX_CPU_ISA): capping it
below AVX512_CORE_BF16 makes a bf16 CPU behave like an AVX2 one (same slow path), and the check below honours the
cap too, so `ONEDNN_MAX_CPU_ISA=AVX2` shows on any machine what an AVX2-only CPU gets.
"""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch

# oneDNN's ISA names in increasing order (its cpu_isa_t); bf16 matmuls are native from AVX512_CORE_BF16 on.
# AVX10_1_512 is AVX512_CORE_FP16 under its newer name, AVX10_1_512_AMX is AVX512_CORE_AMX.
ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
               "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX",
               "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16", "ALL")
FIRST_NATIVE_BF16_ISA = ONEDNN_ISAS.index("AVX512_CORE_BF16")


@dataclass(frozen=True)
class Bf16Support:
    """Whether bf16 matmuls run natively, and the situation that decides it in words (for the run header and
    warnings)."""

    native: bool
    why: str


def onednn_isa_cap() -> str | None:
    """The ISA cap set for oneDNN in the environment (upper case), or None when there is none."""
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = os.environ.get(var, "").strip()
        if value:
            return value.upper()
    return None


def cpu_isa() -> str:
    """A short name of the instruction sets that decide matmul speed: torch's kernel capability, the bf16
    extensions the CPU reports and any oneDNN cap, e.g. 'AVX512+AVX512-BF16' or 'AVX512+AVX512-BF16 capped at AVX2'."""
    parts = [torch.backends.cpu.get_cpu_capability()]
    if torch.cpu._is_avx512_bf16_supported():
        parts.append("AVX512-BF16")
    if torch.cpu._is_amx_tile_supported():
        parts.append("AMX")
    cap = onednn_isa_cap()
    return "+".join(parts) + (f" capped at {cap}" if cap else "")


def cpu_bf16_support() -> Bf16Support:
    """Native bf16 matmuls on this CPU: AVX512-BF16 or AMX, unless oneDNN is capped below them."""
    isa = cpu_isa()
    has_units = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if not has_units:
        return Bf16Support(False, f"this CPU ({cpu_name()}, {isa}) has no native bf16 matmuls (no AVX512-BF16 or "
                                  "AMX)")
    cap = onednn_isa_cap()
    if cap is not None and cap in ONEDNN_ISAS and ONEDNN_ISAS.index(cap) < FIRST_NATIVE_BF16_ISA:
        return Bf16Support(False, f"this CPU ({cpu_name()}, {isa}) has no native bf16 matmuls: oneDNN is capped "
                                  f"below AVX512_CORE_BF16 (ONEDNN_MAX_CPU_ISA={cap})")
    return Bf16Support(True, f"this CPU ({cpu_name()}, {isa}) computes bf16 matmuls natively")


def cuda_bf16_support(device: torch.device) -> Bf16Support:
    name = torch.cuda.get_device_name(device)
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return Bf16Support(True, f"the GPU ({name}) computes bf16 natively")
    return Bf16Support(False, f"the GPU ({name}) has no native bf16 (before Ampere)")


def bf16_support(device: torch.device) -> Bf16Support:
    return cuda_bf16_support(device) if device.type == "cuda" else cpu_bf16_support()


@functools.lru_cache(maxsize=1)
def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), or the platform's best guess."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"
