"""What a study of the reproduction is: training runs to make (data) and a report section read from their artifacts.

A study never trains or formats numbers itself. It lists its `Point`s (one training run each, plus the evaluations
made afterwards in the same run directory); the runner makes every point's run directory, resuming or skipping it;
then the study's `analyse` reads the artifacts through `Artifacts`, which hands back each number as a `Value` that
carries its `Source`s, and writes its section through a `Writer`, which renders each `Value` with a reference to
the run directory, the artifact file and the key it came from (and that run's config hash and commit). A number in
the report that did not come through `Artifacts` has no source, and the writer refuses it: that is how the report
stays traceable.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence


@dataclass(frozen=True)
class Scale:
    """How big the studies are: "smoke" (toy sizes, minutes, run in CI) or "full" (the committed report)."""

    name: str                 # "smoke" | "full"
    corpus: Path              # text corpus the studies train on (a file or a directory of .txt files)
    work: Path                # the study's output root: runs/, shards/, figures/ and the report live under it
    max_parallel: int = 1     # training runs in flight at once
    budget: float = 1.0       # multiplier of the full studies' training steps (from --budget-minutes; 1 for smoke)
    seq_len: int = 128        # the rows of the scale's shards: every point trains at this model.seq_len
    vocab_size: int = 4096    # the scale's tokenizer: every point's model.vocab_size (the runner sets both first)
    testbed: str = "corpus"   # what the studies train on: "corpus" (text, the paper's setting) or "synth" (k-hop)

    def steps(self, full: int, smoke: int) -> int:
        """A study's step count at this scale: `smoke` for smoke, `full` x budget (at least 10) for full."""
        return smoke if self.name == "smoke" else max(10, round(full * self.budget))


@dataclass(frozen=True)
class Point:
    """One training run of a study, in its own run directory WORK/runs/<study>/<name>.

    `config` is a YAML path relative to the repository root, `overrides` the `--set key=value` applied to it in order
    (the runner sets the scale's model.vocab_size and model.seq_len before them, data.shards and train.out_dir
    after). After training the runner evaluates the final checkpoint at each depth of `eval_depths` (validation
    loss on the first `eval_rows` rows, `python -m megaloop eval --depths ... --val-rows ... --json`, written to
    eval.json in the run directory) when the tuple is not empty.
    """

    study: str
    name: str
    config: str
    overrides: tuple[str, ...] = ()
    nproc: int = 1
    eval_depths: tuple[int, ...] = ()
    labels: dict = field(default_factory=dict, compare=False, hash=False)  # what the study varies: {"lr": 0.01, ...}
    eval_rows: int = 256  # validation rows the evaluation scores (the first ones: the same rows for every point)
    kind: str = "train"   # train | bench (`megaloop bench` -> bench.json) | ragged (ragged vs masked loop -> ragged.json)
    bench_steps: int = 10  # kind bench/ragged: measured steps (micro-batches for ragged), after 2 warm-up steps
    eval_tasks: str = "val"  # what the evaluation scores (`megaloop eval --tasks`): val, or synth (answer accuracy
    #                          and loss by hops on the synth testbed's held-out rows, eval.json's "synth")


@dataclass(frozen=True)
class Source:
    """Where a number was read: a file of a run directory (relative to WORK) and the key within it."""

    run: str      # run directory relative to Scale.work, e.g. "runs/stability/parcae-lr0.02"
    file: str     # artifact inside it: "summary.json", "eval.json", "metrics.jsonl", "bench.json", ...
    key: str      # a dotted path in a JSON file, or "<kind>[<step>].<field>" for metrics.jsonl records


@dataclass(frozen=True)
class Value:
    """A number of the report and the artifacts it was computed from (one for a read, several for a fit)."""

    value: float
    sources: tuple[Source, ...]
    how: str = ""   # empty for a value read as is; else how it was derived, e.g. "vertex of the parabola fit"


class Artifacts(Protocol):
    """Read access to the finished points' run directories; every number comes back as a `Value` with its source."""

    def run_dir(self, point: Point) -> Path: ...

    def scalar(self, point: Point, file: str, key: str) -> Value:
        """One number from a JSON artifact of the point's run directory (dotted key, list indices as digits)."""

    def series(self, point: Point, kind: str, field: str) -> tuple[list[int], list[float], Source]:
        """(steps, values, source) of one field of one record kind of the point's metrics.jsonl."""

    def derived(self, value: float, inputs: Sequence[Value], how: str) -> Value:
        """A number computed from other `Value`s (a fit, a mean, a ratio): it carries all their sources."""

    def has(self, point: Point, file: str) -> bool:
        """Whether the point's run directory holds this artifact (e.g. eval.json is absent for a diverged run)."""

    def outcome(self, point: Point) -> dict:
        """The runner's record of how the point ended (done.json): {"exit_code", "outcome": "completed" | "diverged",
        "message"}; {} for a point not finished."""


class Writer(Protocol):
    """Writes one study's section of the report: markdown text, tables and figures, each number with its source."""

    def text(self, markdown: str) -> None: ...

    def num(self, value: Value, fmt: str = ".4g") -> str:
        """The value formatted for the text, with a reference to its sources (listed at the end of the report)."""

    def table(self, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        """A markdown table; cells that are `Value`s are formatted by `num`, strings are written as they are."""

    def figure(self, name: str, caption: str, sources: Sequence[Value]) -> Path:
        """The path to save a PNG at (beside the report, in the --out folder), embedded with its caption and the
        sources it plots."""


class Study(Protocol):
    """One of the paper's claims tested at CPU scale."""

    name: str    # directory-safe id: "stability", "depth_sampling", "testtime", "isoflop", "throughput"
    title: str   # the section heading

    def points(self, scale: Scale) -> list[Point]:
        """The training runs this study needs at this scale (deterministic: the same list on every call)."""

    def analyse(self, scale: Scale, runs: Artifacts, out: Writer) -> None:
        """Read the finished points and write the section: results, fits, plots, and where they disagree with
        the paper and why."""
