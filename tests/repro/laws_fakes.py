"""Stand-ins for the reproduction's artifact reader and report writer, as the studies of the laws see them: the
reader takes numbers from JSON files of run directories laid out as WORK/runs/<study>/<point name>/ and hands them
back with their source; the writer refuses a number that has none."""
from __future__ import annotations

import json
from pathlib import Path

from megaloop.repro.study import Point, Source, Value


class FakeArtifacts:
    def __init__(self, work: Path):
        self.work = Path(work)

    def run_dir(self, point: Point) -> Path:
        return self.work / "runs" / point.study / point.name

    def scalar(self, point: Point, file: str, key: str) -> Value:
        value = json.loads((self.run_dir(point) / file).read_text())
        for part in key.split("."):
            value = value[int(part)] if isinstance(value, list) else value[part]
        return Value(float(value), (Source(f"runs/{point.study}/{point.name}", file, key),))

    def series(self, point: Point, kind: str, field: str):
        rows = [json.loads(line) for line in (self.run_dir(point) / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if r.get("kind") == kind and field in r]
        return ([r["step"] for r in rows], [float(r[field]) for r in rows],
                Source(f"runs/{point.study}/{point.name}", "metrics.jsonl", f"{kind}[*].{field}"))

    def derived(self, value: float, inputs, how: str) -> Value:
        sources = tuple(dict.fromkeys(s for v in inputs for s in v.sources))
        return Value(float(value), sources, how)


class FakeWriter:
    def __init__(self, figures: Path):
        self.figures_dir = Path(figures)
        self.parts: list[str] = []
        self.values: list[Value] = []
        self.tables: list[tuple[list, list]] = []
        self.figures: list[Path] = []

    def text(self, markdown: str) -> None:
        self.parts.append(markdown)

    def num(self, value: Value, fmt: str = ".4g") -> str:
        if not isinstance(value, Value) or not value.sources:
            raise AssertionError(f"a number without a source reached the writer: {value!r}")
        self.values.append(value)
        return f"{value.value:{fmt}}"

    def table(self, header, rows) -> None:
        cells = []
        for row in rows:
            assert len(row) == len(header), (header, row)
            for c in row:
                assert isinstance(c, (Value, str)), f"a table cell is neither a Value nor a string: {c!r}"
            cells.append([self.num(c) if isinstance(c, Value) else c for c in row])
        self.tables.append((list(header), cells))
        self.parts.append("\n".join("| " + " | ".join(r) + " |" for r in [list(header)] + cells))

    def figure(self, name: str, caption: str, sources) -> Path:
        assert sources and all(isinstance(v, Value) and v.sources for v in sources)
        path = self.figures_dir / f"{name}.png"
        self.figures.append(path)
        return path

    @property
    def markdown(self) -> str:
        return "\n\n".join(self.parts)


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
