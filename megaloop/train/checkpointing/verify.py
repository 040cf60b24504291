"""Which checkpoint a run can load: every rank verifies a byte-balanced share of the arrays (together they read
the checkpoint once), and a checkpoint that fails on any rank is said in one line, set aside when it is the run's
own, and the one before it is tried."""
from __future__ import annotations

from pathlib import Path

from megaloop.train.checkpointing.common import ResumeError
from megaloop.train.protocols import TrainerRuntime


def verify_share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """The arrays this rank verifies: balanced by bytes over the ranks (largest first to the least loaded), so that
    together they read the checkpoint once."""
    from pipeline.dist_muon import assign_owners

    names = sorted(sizes)
    return [n for n, owner in zip(names, assign_owners([sizes[n] for n in names], world)) if owner == rank]


def open_verified(candidates: list[Path], runtime: TrainerRuntime, set_aside, note):
    """The newest candidate whose files verify on every rank. One that fails is said in one line (what was found,
    what happens next) and handed to set_aside(path) -> where it is now (moved when it is this run's own); then the
    next candidate is tried. ResumeError when none verifies."""
    from checkpoints.errors import CheckpointError
    from checkpoints.load import CheckpointReader

    shown = candidates[-1]
    for index, path in enumerate(candidates):
        error = None
        try:
            reader = CheckpointReader(path)
            sizes = {n: a.nbytes for n, a in reader.arrays.items()}
            reader.verify(verify_share(sizes, runtime.rank, runtime.world_size))
        except CheckpointError as err:
            error = str(err)
        errors = [e for e in runtime.all_gather_object(error) if e]
        if not errors:
            return reader
        shown = set_aside(path)
        moved = f", set aside as {shown.name}" if shown != path else ""
        nxt = (f"resuming from {candidates[index + 1].name} instead" if index + 1 < len(candidates)
               else "no other checkpoint to resume from")
        note(f"checkpoint {path.name} is unusable ({first_problem(errors[0], path)}){moved}; {nxt}")
    if shown != candidates[-1]:  # set aside (this run's own checkpoints): the next attempt starts afresh
        todo = "run the same command again to start the run afresh (its metrics are kept beside the new ones)"
    else:
        todo = "point checkpoint.resume at another checkpoint, or leave it null to start afresh"
    raise ResumeError(f"no checkpoint could be loaded (`python -m checkpoints verify {shown}` shows what is "
                      f"wrong); {todo}")


def first_problem(error: str, path: Path) -> str:
    """A verification error without the checkpoint's path, which the line names already, and cut to its first
    sentence."""
    text = error.replace(f"{path}/", "").replace(f"{path}: ", "").replace(str(path), path.name)
    return text.split("; ")[0]
