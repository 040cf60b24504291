"""What a preflight path found, and how it is printed: one progress line per path, a summary table, JSON."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass


@dataclass
class PathResult:
    """One path's outcome. busbw_gbs: its measured bus bandwidth (GB/s, nccl-tests' convention) over `link`;
    expected_gbs: the link's nominal rate where known (None on CPU or an unknown GPU)."""

    name: str
    ok: bool
    detail: str
    seconds: float = 0.0
    busbw_gbs: float | None = None
    expected_gbs: float | None = None
    link: str = ""
    slow: bool = False  # below --min-bw-fraction of the expected rate (a failure only when that option is given)

    @property
    def status(self) -> str:
        return "PASS" if self.ok and not self.slow else "FAIL"


def _gbs(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.3g}"


def bandwidth_text(r: PathResult) -> str:
    if r.busbw_gbs is None:
        return "-"
    text = f"{_gbs(r.busbw_gbs)} GB/s"
    if r.expected_gbs:
        text += f" of {_gbs(r.expected_gbs)} ({100 * r.busbw_gbs / r.expected_gbs:.0f}%)"
    return text + (f" {r.link}" if r.link else "")


def progress_line(index: int, total: int, r: PathResult) -> str:
    slow = " (bandwidth below --min-bw-fraction of the expected rate)" if r.slow else ""
    return (f"[{index}/{total}] {r.name}: {r.status} in {r.seconds:.1f} s, bus bandwidth {bandwidth_text(r)}; "
            f"{r.detail}{slow}")


def table(results: list[PathResult]) -> str:
    """The summary: one row per path (status, bus bandwidth against the expected rate, seconds)."""
    rows = [(r.name, r.status, bandwidth_text(r), f"{r.seconds:.1f}") for r in results]
    head = ("path", "result", "bus bandwidth (measured of expected)", "s")
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [head, *rows]]
    passed = sum(r.status == "PASS" for r in results)
    return "\n".join(lines + [f"preflight: {passed}/{len(results)} paths passed"])


def as_json(results: list[PathResult], world: dict) -> str:
    return json.dumps({"ok": all(r.status == "PASS" for r in results), "world": world,
                       "paths": [asdict(r) | {"status": r.status} for r in results]})
