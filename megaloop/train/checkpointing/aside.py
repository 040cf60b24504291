"""Setting a run's checkpoints aside: a corrupt one (<name>.corrupt) and, after a loss spike, those of the spike's
step or later (<name>.after-spike). They are kept for inspection but no longer counted by retention nor tried, and
`latest` always names a checkpoint that is there (or is removed). Another run's checkpoints are never touched."""
from __future__ import annotations

from pathlib import Path

from megaloop.train.protocols import TrainerRuntime


class Shelf:
    """Set-aside checkpoints of the run whose checkpoints live in `root`; every method is called by every rank."""

    def __init__(self, root: Path, runtime: TrainerRuntime, note):
        self.root, self.runtime, self.note = root, runtime, note

    def unusable(self) -> bool:
        """This run's checkpoints were all set aside as corrupt (<name>.corrupt) and none is left."""
        return any(self.root.glob("step_*.corrupt")) if self.root.is_dir() else False

    def set_aside(self, path: Path, suffix: str = "corrupt") -> Path:
        """Rename a checkpoint of this run to <name>.<suffix> and point `latest` at the newest committed checkpoint
        left (or remove it when none is left); rank 0 decides. Where the checkpoint is now."""
        from checkpoints import files
        from checkpoints.load import find_checkpoints

        self.runtime.barrier()  # every rank is done reading it
        aside = path.with_name(f"{path.name}.{suffix}")
        if path.parent.resolve() != self.root.resolve():
            return path
        moved = False
        if self.runtime.is_main and not aside.exists():
            path.rename(aside)
            left = [p for p in find_checkpoints(self.root) if p.name != path.name]
            if left:
                files.atomic_write_text(self.root / "latest", max(left, key=lambda p: p.name).name + "\n")
            else:
                (self.root / "latest").unlink(missing_ok=True)
            moved = True
        moved = self.runtime.all_gather_object(moved)[0]  # rank 0's verdict; `latest` is settled for every rank
        return aside if moved else path

    def set_aside_from(self, step: int, suffix: str) -> int:
        """Set aside this run's committed checkpoints of `step` or later (after a loss spike at `step` they may
        hold its damage); the newest step left (0: none)."""
        from checkpoints.files import step_of
        from checkpoints.load import find_checkpoints

        later = [str(p) for p in find_checkpoints(self.root) if (step_of(p.name) or 0) >= step]
        for path in self.runtime.all_gather_object(later)[0]:
            moved = self.set_aside(Path(path), suffix)
            self.note(f"checkpoint {Path(path).name} is from the loss spike's step or later: set aside as "
                      f"{moved.name}")
        left = [step_of(p.name) or 0 for p in find_checkpoints(self.root)]
        return self.runtime.all_gather_object(max(left, default=0))[0]
