"""Read access to the points' run directories (megaloop.repro.study.Artifacts): every number comes back as a Value
that names the run directory, the file and the key it was read from."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

from megaloop.repro.runner import run_dir
from megaloop.repro.study import Point, Scale, Source, Value


class MissingArtifact(LookupError):
    """A study asked for a file or key that its run directory does not hold."""


class RunArtifacts:
    """megaloop.repro.study.Artifacts over WORK/runs."""

    def __init__(self, scale: Scale):
        self.scale = scale
        self._json: dict[Path, dict] = {}

    def run_dir(self, point: Point) -> Path:
        return run_dir(self.scale, point)

    def _rel(self, point: Point) -> str:
        return self.run_dir(point).relative_to(self.scale.work).as_posix()

    def _load(self, point: Point, file: str) -> dict:
        path = self.run_dir(point) / file
        if path not in self._json:
            try:
                self._json[path] = json.loads(path.read_text())
            except FileNotFoundError:
                raise MissingArtifact(f"{path} does not exist (the point has not finished: run the study without "
                                      "--report-only)") from None
        return self._json[path]

    def scalar(self, point: Point, file: str, key: str) -> Value:
        node = self._load(point, file)
        for part in key.split("."):
            try:
                node = node[int(part)] if isinstance(node, list) else node[part]
            except (KeyError, IndexError, ValueError, TypeError):
                raise MissingArtifact(f"{self.run_dir(point) / file} has no key {key!r}") from None
        if isinstance(node, bool) or not isinstance(node, (int, float)):
            raise MissingArtifact(f"{self.run_dir(point) / file}: {key!r} is {node!r}, not a number")
        return Value(float(node), (Source(self._rel(point), file, key),))

    def records(self, point: Point, kind: str) -> list[dict]:
        """The point's metrics.jsonl records of one kind, each step's last (a resumed job's records supersede those
        an earlier job wrote after the checkpoint it resumed from), in step order."""
        path = self.run_dir(point) / "metrics.jsonl"
        if not path.is_file():
            raise MissingArtifact(f"{path} does not exist")
        by_step: dict = {}
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill: the resumed job rewrites that step
                continue
            if r.get("kind") == "resume":
                by_step = {k: v for k, v in by_step.items() if k[0] <= r["step"]}
            elif r.get("kind") == kind:
                by_step[(r["step"], r.get("T"))] = r
        return [by_step[k] for k in sorted(by_step)]

    def series(self, point: Point, kind: str, field: str) -> tuple[list[int], list[float], Source]:
        recs = [r for r in self.records(point, kind) if field in r]
        steps = [int(r["step"]) for r in recs]
        span = f"{steps[0]}..{steps[-1]}" if steps else ""
        return steps, [float(r[field]) for r in recs], Source(self._rel(point), "metrics.jsonl",
                                                               f"{kind}[{span}].{field}")

    def series_value(self, point: Point, kind: str, field: str, reduce: str) -> Value:
        """One number from a metrics series: reduce is max, min, mean, first, last, count or finite_max."""
        steps, values, src = self.series(point, kind, field)
        finite = [v for v in values if math.isfinite(v)]
        fns = {"max": lambda: max(values), "min": lambda: min(values), "first": lambda: values[0],
               "last": lambda: values[-1], "count": lambda: float(len(values)),
               "mean": lambda: sum(values) / len(values), "finite_max": lambda: max(finite) if finite else math.nan}
        value = fns[reduce]() if values or reduce == "count" else math.nan
        return Value(float(value), (src,), how=f"{reduce} over the records")

    def derived(self, value: float, inputs: Sequence[Value], how: str) -> Value:
        sources = tuple(dict.fromkeys(s for v in inputs for s in v.sources))
        if not sources:
            raise ValueError(f"a derived number ({how}) needs inputs that carry sources")
        return Value(float(value), sources, how)

    def has(self, point: Point, file: str) -> bool:
        return (self.run_dir(point) / file).is_file()

    def outcome(self, point: Point) -> dict:
        try:
            return json.loads((self.run_dir(point) / "done.json").read_text())
        except FileNotFoundError:
            return {}
