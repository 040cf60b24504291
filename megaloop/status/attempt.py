"""The current attempt's heartbeat lines (megaloop.train.heartbeat): only they say where the job is now; the lines of
earlier attempts (before a restart or a requeue) describe processes that are gone.

The current attempt is the one of the newest "start" line. Its start lines are told from an earlier attempt's by
order as well as by id (a local run started again in the same folder keeps the id "local.0.0"): the ranks of one
attempt synchronise every step, so every rank writes its start line before any rank writes a step line of that
attempt, and every line an earlier attempt wrote comes before the current attempt's start lines. So a rank's
current lines begin at its newest start line of the current id written after the last step or end line that
precedes the newest start (clocks of the nodes agreeing to well under a step).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class CurrentAttempt:
    attempt: str | None = None  # the id of the newest start line (None: no rank has started yet)
    started_at: float | None = None  # the newest start line's time (unix)
    lines: dict[int, list[dict]] = field(default_factory=dict)  # rank -> its lines of this attempt, start first
    earlier: dict[int, dict] = field(default_factory=dict)  # rank -> its newest line, for ranks with none in this one


def _usable(line) -> bool:
    """A heartbeat line with an event and a numeric time (anything else, e.g. from another tool, is left out)."""
    return (isinstance(line, dict) and isinstance(line.get("event"), str)
            and isinstance(line.get("time"), (int, float)) and math.isfinite(line["time"]))


def current_attempt(heartbeats: dict[int, list[dict]]) -> CurrentAttempt:
    """Split each rank's lines (read_heartbeats) into the current attempt's and the rest (see the module doc)."""
    clean = {rank: [x for x in lines if _usable(x)] for rank, lines in heartbeats.items()}
    starts = [x for lines in clean.values() for x in lines if x["event"] == "start"]
    if not starts:
        return CurrentAttempt(earlier={rank: lines[-1] for rank, lines in clean.items() if lines})
    newest = max(starts, key=lambda x: x["time"])
    boundary = max((x["time"] for lines in clean.values() for x in lines
                    if x["event"] != "start" and x["time"] < newest["time"]), default=-math.inf)
    found = CurrentAttempt(attempt=newest.get("attempt"), started_at=newest["time"])
    for rank, lines in sorted(clean.items()):
        first = next((i for i in range(len(lines) - 1, -1, -1) if lines[i]["event"] == "start"
                      and lines[i].get("attempt") == found.attempt and lines[i]["time"] > boundary), None)
        if first is not None:
            found.lines[rank] = lines[first:]
        elif lines:
            found.earlier[rank] = lines[-1]
    return found
