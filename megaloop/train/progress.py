"""The terminal progress bar: loss, tokens/s and MFU on one tqdm line."""
from __future__ import annotations

import math
import sys


class Progress:
    def __init__(self, total: int, enabled: bool = True):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, record: dict) -> None:
        if self.bar is None:
            return
        mfu = record["mfu"]
        self.bar.set_postfix_str(
            f"loss {record['loss']:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
            f"MFU {'n/a' if not math.isfinite(mfu) else f'{100 * mfu:.1f}%'} | T~{record['mean_depth']:.1f}",
            refresh=False)
        self.bar.update(1)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(f"[val] {text}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
