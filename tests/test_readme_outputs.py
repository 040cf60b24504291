"""Output quoted in README.md is the output the command prints today: a ```text block of output carries the marker
`<!-- readme-walk: output (COMMAND) -->` on the line above it, and this test runs COMMAND and requires every quoted
line, in order, among the lines it prints. A ```text block without the marker may hold commands only (lines that
start with `python`, `bash` or `#`), so no unchecked output can be quoted."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme_walk import fenced_blocks

REPO = Path(__file__).resolve().parents[1]
OUTPUT_MARK = re.compile(r"<!--\s*readme-walk:\s*output\s*\((?P<command>[^)]*)\)\s*-->")
COMMAND_LINE = re.compile(r"^(python|bash|#)\b")


def text_blocks(text: str) -> list[tuple[int, str | None, list[str]]]:
    """(line of the fence, the output marker's command or None, the block's lines) for every ```text block."""
    found = []
    for line, above, body in fenced_blocks(text, "text"):
        mark = OUTPUT_MARK.search(above)
        found.append((line, mark.group("command") if mark else None, body))
    return found


BLOCKS = text_blocks((REPO / "README.md").read_text())


def in_order(quoted: list[str], printed: list[str]) -> str | None:
    """The first quoted line not found (in order) among the printed ones, else None."""
    at = 0
    for line in (q.rstrip() for q in quoted if q.strip()):
        while at < len(printed) and printed[at].rstrip() != line:
            at += 1
        if at == len(printed):
            return line
        at += 1
    return None


def test_unmarked_text_blocks_hold_commands_only():
    for line, command, body in BLOCKS:
        if command is None:
            offenders = [b for b in body if b.strip() and not COMMAND_LINE.match(b.strip())]
            assert not offenders, (f"README.md:{line}: a ```text block quotes output without a "
                                   f"`<!-- readme-walk: output (COMMAND) -->` marker: {offenders[0]!r}")


@pytest.mark.parametrize("line, command, body", [b for b in BLOCKS if b[1] is not None],
                         ids=lambda v: str(v) if isinstance(v, int) else None)
def test_quoted_output_is_what_the_command_prints(line, command, body):
    argv = shlex.split(command)
    assert argv[0] == "python", f"README.md:{line}: the marker's command runs with python: {command}"
    done = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    missing = in_order(body, done.stdout.splitlines())
    assert missing is None, f"README.md:{line}: `{command}` no longer prints {missing!r} (update the quote)"


def test_the_check_catches_a_stale_quote():
    assert in_order(["a", "c"], ["a", "b", "c"]) is None
    assert in_order(["c", "a"], ["a", "b", "c"]) == "a"
    assert in_order(["simulated makespan 313.40"], ["simulated makespan 310.48"]) == "simulated makespan 313.40"
