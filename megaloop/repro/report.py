"""The report: each study's section written through a MarkdownWriter (megaloop.repro.study.Writer), which renders
every number with a numbered reference to the run artifacts it came from; the references are listed at the end
with each run's config hash and commit. A number that does not come as a Value with sources is refused.

The report is a function of the artifacts: its date is the latest point's finish time, its commits those of the
runs, its command the canonical one for the scale and studies (no machine paths, no clock)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from megaloop.repro import registry
from megaloop.repro.study import Scale, Value


class UnsourcedNumber(TypeError):
    """A number reached the writer without the artifact it was read from."""


class SourceIndex:
    """Numbers the distinct (sources, how) of the report in order of first use; `anchor` names their HTML anchors
    (ANCHOR-N), distinct per testbed since both testbeds' sections share one file."""

    def __init__(self, work: Path, anchor: str = "src"):
        self.work = work
        self.anchor = anchor
        self.refs: dict[tuple, int] = {}

    def ref(self, value: Value) -> int:
        if not isinstance(value, Value) or not value.sources:
            raise UnsourcedNumber(f"{value!r} has no source: read numbers through the study's Artifacts (a Value "
                                  "with its run directory, file and key), or write them as text if they are not "
                                  "results")
        key = (value.sources, value.how)
        return self.refs.setdefault(key, len(self.refs) + 1)

    def run_meta(self, run: str) -> str:
        try:
            p = json.loads((self.work / run / "point.json").read_text())
        except FileNotFoundError:
            return "no point.json"
        return f"config {p['config_hash']}, commit {p['commit'][:12]}{' (dirty)' if p.get('dirty') else ''}"

    def listing(self) -> list[str]:
        lines = []
        for (sources, how), n in sorted(self.refs.items(), key=lambda kv: kv[1]):
            parts = [f"`{s.run}` {s.file} `{s.key}` ({self.run_meta(s.run)})" for s in sources]
            lead = f"{how}: " if how else ""
            lines.append(f"<a id=\"{self.anchor}-{n}\"></a>{n}. {lead}" + "; ".join(parts))
        return lines


class MarkdownWriter:
    """megaloop.repro.study.Writer for one section; figures go to FIG_DIR, linked relative to the report."""

    def __init__(self, index: SourceIndex, fig_dir: Path, report_dir: Path, prefix: str):
        self.index, self.fig_dir, self.report_dir, self.prefix = index, fig_dir, report_dir, prefix
        self.lines: list[str] = []

    def text(self, markdown: str) -> None:
        self.lines.append(markdown.rstrip() + "\n")

    def num(self, value: Value, fmt: str = ".4g") -> str:
        n = self.index.ref(value)
        return f"{format(value.value, fmt)}<sup>[{n}](#{self.index.anchor}-{n})</sup>"

    def cell(self, c: object) -> str:
        if isinstance(c, Value):
            return self.num(c)
        if c is None:
            return "–"
        if isinstance(c, str):
            return c.replace("|", "\\|")
        raise UnsourcedNumber(f"table cell {c!r} is a bare {type(c).__name__}: pass a Value (read through "
                              "Artifacts) or a string label")

    def table(self, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        out += ["| " + " | ".join(self.cell(c) for c in row) + " |" for row in rows]
        self.lines.append("\n".join(out) + "\n")

    def figure(self, name: str, caption: str, sources: Sequence[Value]) -> Path:
        refs = sorted({self.index.ref(v) for v in sources})
        if not refs:
            raise UnsourcedNumber(f"figure {name!r} names no sources: pass the Values it plots")
        path = self.fig_dir / f"{self.prefix}-{name}.png"
        rel = os.path.relpath(path, self.report_dir)
        cites = ", ".join(f"[{n}](#{self.index.anchor}-{n})" for n in refs)
        self.lines.append(f"![{caption}]({rel})\n\n*{caption}* (data: {cites})\n")
        return path


SYNTH_BEGIN = "<!-- testbed synth: begin (written by python -m megaloop repro --testbed synth) -->"
SYNTH_END = "<!-- testbed synth: end -->"


def render(scale: Scale, studies: list[str], out: Path, command: str, plans_by_study: dict, artifacts) -> Path:
    """Run each study's analyse into its section; write OUT.md and its figures in OUT/; returns the report's path.

    The corpus testbed writes the whole file and keeps the synth testbed's block (between SYNTH_BEGIN and SYNTH_END)
    at its end; the synth testbed replaces only that block (appending it, or starting the file, where there is none),
    so that either testbed's report is re-rendered without the other's runs."""
    report = out.parent / f"{out.name}.md"
    out.mkdir(parents=True, exist_ok=True)
    table = registry.studies_of(scale.testbed)
    for name, _, _ in table:  # this testbed's figures of an earlier render that this one may not redraw
        for old in out.glob(f"{name}-*.png"):
            old.unlink()
    index = SourceIndex(scale.work, "synth-src" if scale.testbed == "synth" else "src")
    sections = []
    for name, letter, title in table:
        head = f"## ({letter}) {title}\n"
        if name not in studies:
            sections.append(head + f"\nNot part of this report (run with `--studies {name}`).\n")
            continue
        w = MarkdownWriter(index, out, report.parent, name)
        registry.load(name).analyse(scale, artifacts, w)
        sections.append(head + "\n" + "\n".join(w.lines))
    meta = _header_facts(scale, plans_by_study)
    facts = (f"Generated by `{command}` from the runs of commit(s) {meta['commits']}; the last point finished "
             f"{meta['date']}. Scale: {scale.name} (model and data sizes in megaloop/repro/sizes.py; budget x"
             f"{scale.budget:g}; {meta['points']} points). Every number links to the run artifact it was read from "
             f"(listed under Sources, with the run's config hash and commit).")
    old = report.read_text() if report.is_file() else ""
    if scale.testbed == "synth":
        block = "\n".join([SYNTH_BEGIN, "# The synthetic testbed: where the loop has work to do", "", facts, "",
                           *sections, "## Sources (synthetic testbed)", "", *index.listing(), "", SYNTH_END])
        report.write_text(_with_block(old, block))
        return report
    lines = ["# Reproduction of Parcae's claims at CPU scale", "", facts, "", *sections, "## Sources", "",
             *index.listing(), ""]
    kept = _block(old)
    report.write_text("\n".join(lines) + (f"\n{kept}\n" if kept else ""))
    return report


def _block(text: str) -> str:
    """The synth testbed's block of a report ("" when it has none)."""
    if SYNTH_BEGIN not in text or SYNTH_END not in text:
        return ""
    return text[text.index(SYNTH_BEGIN):text.index(SYNTH_END) + len(SYNTH_END)]


def _with_block(text: str, block: str) -> str:
    """`text` with its synth block replaced by `block` (appended where it has none; the block alone when empty)."""
    kept = _block(text)
    if kept:
        return text.replace(kept, block)
    return (text.rstrip("\n") + "\n\n" if text.strip() else "") + block + "\n"


def _header_facts(scale: Scale, plans_by_study: dict) -> dict:
    commits, dates, n = set(), [], 0
    for plans in plans_by_study.values():
        for d in plans:
            n += 1
            try:
                done = json.loads((d / "done.json").read_text())
            except FileNotFoundError:
                continue
            commits.add(done["commit"][:12] + (" (dirty)" if done.get("dirty") else ""))
            dates.append(done["finished"])
    return {"commits": ", ".join(sorted(commits)) or "none", "date": max(dates) if dates else "never", "points": n}
