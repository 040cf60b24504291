"""The studies of the reproduction, in the report's order (a..e), each a module of megaloop.repro.studies that
exposes STUDY. Modules are imported only when their study is selected, so that a missing one is an error for the
runs that need it and for no other."""
from __future__ import annotations

import importlib

from megaloop.config import ConfigError

# (name, letter, title): the name is the module under megaloop/repro/studies and the runs/<name> folder
STUDIES = (
    ("stability", "a", "Stability across a learning-rate sweep"),
    ("depth_sampling", "b", "Per-sequence vs per-batch depth sampling"),
    ("testtime", "c", "Test-time depth scaling"),
    ("isoflop", "d", "isoFLOP: the compute-optimal loop depth"),
    ("throughput", "e", "Throughput: useful vs executed FLOPs"),
)
NAMES = tuple(name for name, _, _ in STUDIES)


def available() -> list[str]:
    """The registered studies whose module is present in this checkout."""
    return [name for name in NAMES if importlib.util.find_spec(f"megaloop.repro.studies.{name}") is not None]


def parse_selection(text: str | None) -> list[str]:
    """--studies a,b,...: registered names or letters, in the report's order; None: every registered study."""
    if text is None:
        return list(NAMES)
    by_letter = {letter: name for name, letter, _ in STUDIES}
    chosen = set()
    for part in (p.strip() for p in text.split(",")):
        name = by_letter.get(part, part)
        if name not in NAMES:
            raise ConfigError("--studies", part, f"is not a study; choose among {', '.join(NAMES)} (or their letters "
                              "a..e), comma-separated")
        chosen.add(name)
    return [name for name in NAMES if name in chosen]


def load(name: str):
    """The STUDY object of a registered study (its module imported now)."""
    try:
        module = importlib.import_module(f"megaloop.repro.studies.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"megaloop.repro.studies.{name}":
            raise
        raise ConfigError("--studies", name, f"its module megaloop/repro/studies/{name}.py is not in this checkout; "
                          f"leave it out with --studies {','.join(n for n in available() if n != name)}") from None
    return module.STUDY


def letter(name: str) -> str:
    return next(letter for n, letter, _ in STUDIES if n == name)


def title(name: str) -> str:
    return next(t for n, _, t in STUDIES if n == name)
