"""The terminal progress bar: loss, tokens/s and MFU on one tqdm line; `[val]` lines with their step; a second,
transient bar while validation runs (validation_losses finds the bar of this process through active())."""
from __future__ import annotations

import math
import re
import sys

_ACTIVE = None  # the Progress that was made last in this process (None when it was disabled or closed)


def active():
    """The open, enabled Progress of this process, if any (so validation can show how far it is)."""
    return _ACTIVE if _ACTIVE is not None and _ACTIVE.bar is not None else None


def _make_active(progress) -> None:
    global _ACTIVE
    _ACTIVE = progress


class Progress:
    """The training bar over optimizer steps; its postfix also counts tokens (done / the run's), so a run given in
    train.tokens reads in both units."""

    def __init__(self, total: int, enabled: bool = True, initial: int = 0, tokens_per_step: int = 0):
        self.bar = None
        self.tokens_per_step = tokens_per_step
        _make_active(self)
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr)

    def update(self, record: dict) -> None:
        if self.bar is None:
            return
        mfu = record["mfu"]
        self.bar.set_postfix_str(
            f"loss {record['loss']:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
            f"MFU {'n/a' if not math.isfinite(mfu) else f'{100 * mfu:.1f}%'} | T~{record['mean_depth']:.1f}"
            + self._tokens(self.bar.n + 1), refresh=False)
        self.bar.update(1)

    def _tokens(self, steps: int) -> str:
        """' | 1.05M/104B tok': the tokens of `steps` steps and of the whole run ('' without tokens_per_step)."""
        if not self.tokens_per_step:
            return ""
        from megaloop.config.budget import human_tokens

        return (f" | {human_tokens(steps * self.tokens_per_step)}/"
                f"{human_tokens(self.bar.total * self.tokens_per_step)} tok")

    def note(self, text: str) -> None:
        """A `[val] step N: ...` line above the bar (N: optimizer steps done); a NaN loss (no tokens) shows n/a."""
        if self.bar is not None:
            self.bar.write(f"[val] step {self.bar.n}: {re.sub(r'(?<![A-Za-z])nan(?![A-Za-z])', 'n/a', text)}")

    def validation(self, depths: list[int], batches: int) -> "ValidationBar":
        """A transient bar under the training bar for one validation pass over `depths` x `batches`."""
        return ValidationBar(self, depths, batches)

    def close(self) -> None:
        if _ACTIVE is self:
            _make_active(None)
        if self.bar is not None:
            self.bar.close()


class ValidationBar:
    """`val T=4 (3/8 depths)`: advanced per batch by validation_losses, removed when the pass ends."""

    def __init__(self, progress: Progress, depths: list[int], batches: int):
        from tqdm import tqdm

        self.depths = list(depths)
        done = progress.bar.n if progress.bar is not None else 0
        self.bar = tqdm(total=len(self.depths) * batches, desc=f"val at step {done}", unit="batch", leave=False,
                        dynamic_ncols=True, file=sys.stderr)

    def depth(self, depth: int) -> None:
        self.bar.set_postfix_str(f"T={depth} ({self.depths.index(depth) + 1}/{len(self.depths)} depths)",
                                 refresh=False)

    def update(self, n: int = 1) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()
