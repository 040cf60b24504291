"""The studies of the reproduction, in the report's order (a..e on the text corpus, f..i on the synth testbed), each
a module of megaloop.repro.studies that exposes STUDY. Modules are imported only when their study is selected, so
that a missing one is an error for the runs that need it and for no other."""
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
# the synth testbed's (`megaloop repro --testbed synth`): the same claims where the loop has work to do (k-hop)
SYNTH_STUDIES = (
    ("synth_depth", "f", "Depth pays on k-hop: accuracy against T, and the test-time forms per difficulty"),
    ("synth_sampling", "g", "Per-sequence vs per-batch depth sampling on k-hop"),
    ("synth_stability", "h", "Stability at a deep loop (mu_rec 16)"),
    ("synth_isoflop", "i", "isoFLOP on k-hop: the compute-optimal loop depth"),
)
NAMES = tuple(name for name, _, _ in STUDIES)
SYNTH_NAMES = tuple(name for name, _, _ in SYNTH_STUDIES)


def studies_of(testbed: str) -> tuple:
    """(name, letter, title) of the testbed's studies, in the report's order."""
    return SYNTH_STUDIES if testbed == "synth" else STUDIES


def available(testbed: str = "corpus") -> list[str]:
    """The testbed's registered studies whose module is present in this checkout."""
    return [name for name, _, _ in studies_of(testbed)
            if importlib.util.find_spec(f"megaloop.repro.studies.{name}") is not None]


def parse_selection(text: str | None, testbed: str = "corpus") -> list[str]:
    """--studies a,b,...: registered names or letters of the testbed's studies, in the report's order; None: every
    registered study of the testbed."""
    table = studies_of(testbed)
    names = [name for name, _, _ in table]
    if text is None:
        return names
    by_letter = {letter: name for name, letter, _ in table}
    chosen = set()
    for part in (p.strip() for p in text.split(",")):
        name = by_letter.get(part, part)
        if name not in names:
            letters = f"{table[0][1]}..{table[-1][1]}"
            other = "synth" if testbed == "corpus" else "corpus"
            hint = (f"; {part} is a study of --testbed {other}"
                    if any(part in (n, x) for n, x, _ in studies_of(other)) else "")
            raise ConfigError("--studies", part, f"is not a study of --testbed {testbed}; choose among "
                              f"{', '.join(names)} (or their letters {letters}), comma-separated{hint}")
        chosen.add(name)
    return [name for name in names if name in chosen]


def load(name: str):
    """The STUDY object of a registered study (its module imported now)."""
    try:
        module = importlib.import_module(f"megaloop.repro.studies.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"megaloop.repro.studies.{name}":
            raise
        testbed = "synth" if name in SYNTH_NAMES else "corpus"
        raise ConfigError("--studies", name, f"its module megaloop/repro/studies/{name}.py is not in this checkout; "
                          f"leave it out with --studies {','.join(n for n in available(testbed) if n != name)}"
                          ) from None
    return module.STUDY


def letter(name: str) -> str:
    return next(letter for n, letter, _ in STUDIES + SYNTH_STUDIES if n == name)


def title(name: str) -> str:
    return next(t for n, _, t in STUDIES + SYNTH_STUDIES if n == name)
