"""Faults injected on purpose, for the recovery tests and for drills on a real cluster (is recovery wired up before
the first real failure?). Read once from the environment variable MEGALOOP_FAULTS; with it unset (every real run)
nothing here does anything.

MEGALOOP_FAULTS holds faults separated by ";", each `kind:key=value,key=value`:
  slow:rank=R,seconds=S      rank R sleeps S seconds in every training step (a straggler)
  crash:rank=R,at=start      rank R exits with code 1 at start-up, in every attempt (a node that always fails)
  crash:rank=R,step=K        rank R exits with code 1 after step K, in the first attempt that reaches it (an
                             attempt is first when <out_dir>/faults/crash_K does not exist yet; it is created then)
  spike:step=K               the batch of step K has every token replaced by the last vocabulary id: its loss jumps
                             (a corrupted batch), on the first attempt that reaches step K (as crash:step=K)
Ranks are global ranks (RANK). A bad value is refused at start-up with what was wrong.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from megaloop.config import ConfigError

ENV = "MEGALOOP_FAULTS"
KINDS = {"slow": {"rank", "seconds"}, "crash": {"rank", "at", "step"}, "spike": {"step"}}


def _bad(item: str, problem: str) -> ConfigError:
    """MEGALOOP_FAULTS cannot be parsed: a one-line refusal at start-up (exit code 2), like a bad config key."""
    return ConfigError(f"{ENV} (environment)", item, f"{problem}; unset it for a run without injected faults")


@dataclass(frozen=True)
class Fault:
    kind: str
    args: dict = field(default_factory=dict)

    def targets(self, rank: int) -> bool:
        return "rank" not in self.args or int(self.args["rank"]) == rank


def parse(text: str) -> list[Fault]:
    """The faults in a MEGALOOP_FAULTS value (see the module docstring)."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kind, _, rest = item.partition(":")
        if kind not in KINDS:
            raise _bad(item, f"unknown fault {kind!r}; known: {', '.join(sorted(KINDS))}")
        args = {}
        for pair in filter(None, rest.split(",")):
            key, sep, value = pair.partition("=")
            if not sep or key not in KINDS[kind]:
                raise _bad(item, f"{pair!r} is not one of {sorted(KINDS[kind])} as key=value")
            args[key] = value
        try:
            for key in ("rank", "step"):
                if key in args:
                    args[key] = int(args[key])
            if "seconds" in args:
                args["seconds"] = float(args["seconds"])
        except ValueError:
            raise _bad(item, "rank and step are integers, seconds a number") from None
        if kind == "crash" and ("at" in args) == ("step" in args):
            raise _bad(item, "a crash takes exactly one of at=start or step=K")
        if kind == "crash" and args.get("at", "start") != "start":
            raise _bad(item, "at= takes only `start`")
        if kind == "spike" and "step" not in args or kind == "slow" and "seconds" not in args:
            raise _bad(item, f"missing {'step' if kind == 'spike' else 'seconds'}=")
        faults.append(Fault(kind, args))
    return faults


class Faults:
    """This rank's injected faults for one training job; every hook is a no-op when there are none."""

    def __init__(self, rank: int, out_dir: str | Path, text: str | None = None):
        text = os.environ.get(ENV, "") if text is None else text
        self.rank, self.out_dir = rank, Path(out_dir)
        self.faults = [f for f in parse(text) if f.targets(rank)]

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _of(self, kind: str) -> list[Fault]:
        return [f for f in self.faults if f.kind == kind]

    def _first_time(self, name: str) -> bool:
        """Whether this is the first attempt to reach this fault (marked under <out_dir>/faults; every rank that
        injects it checks the same file, so only the first attempt of the run injects it)."""
        mark = self.out_dir / "faults" / name
        if mark.exists():
            return False
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.touch()
        return True

    def at_start(self) -> None:
        """crash:at=start: exit now."""
        if any(f.args.get("at") == "start" for f in self._of("crash")):
            print(f"megaloop: injected fault ({ENV}): rank {self.rank} crashes at start-up", file=sys.stderr,
                  flush=True)
            os._exit(1)

    def in_step(self) -> None:
        """slow: sleep inside every step (its time counts as the step's)."""
        for fault in self._of("slow"):
            time.sleep(fault.args["seconds"])

    def after_step(self, step: int) -> None:
        """crash:step=K: exit after step K (the first attempt that gets there)."""
        for fault in self._of("crash"):
            if fault.args.get("step") == step and self._first_time(f"crash_{step}_rank{self.rank}"):
                print(f"megaloop: injected fault ({ENV}): rank {self.rank} crashes after step {step}",
                      file=sys.stderr, flush=True)
                os._exit(1)

    def corrupt(self, step: int, batch: dict, vocab_size: int) -> dict:
        """spike:step=K: the batch of step K with every token replaced by the last vocabulary id."""
        for fault in self._of("spike"):
            if fault.args["step"] == step and self._first_time(f"spike_{step}_rank{self.rank}"):
                print(f"megaloop: injected fault ({ENV}): the batch of step {step} is corrupted", file=sys.stderr,
                      flush=True)
                batch = dict(batch, tokens=batch["tokens"].clone().fill_(vocab_size - 1))
        return batch
