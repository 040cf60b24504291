"""A walk of README.md as a new user would take it: every ```bash block, in order, in one shell, in a fresh copy
of the working tree, at small sizes; every command must exit 0.

README.md is parsed when the test runs, so a block added later is walked too. A block that cannot run on one
machine (a multi-node launch, say) is skipped only when the line above it is `<!-- readme-walk: skip (reason) -->`;
the test prints what it skipped. A block whose training runs are covered by other tests may be marked
`<!-- readme-walk: check (reason) -->`: its `megaloop train` and `megaloop launch --nproc-per-node N` commands become
`megaloop check` of the same config and overrides (for N processes: WORLD_SIZE=N, the validation launch does before
it starts any process), its other commands run as written. What is changed to keep it small:
- the placeholders TEXT_DIR, TOK_DIR and SHARD_DIR become a two-novel corpus and directories of the walk;
- `megaloop train` and `megaloop launch` commands train 1/50 of their train.steps (2 when none is given), validate on one batch and
  print no progress bar;
- `megaloop eval` commands score the first 64 validation rows (--val-rows 64, when not given: the walk's split
  has ~900 rows, a minute of forwards on a loaded 2-core machine; 64 rows take the same code path);
- `bash scripts/quickstart.sh` runs on the same small corpus with those overrides, in OUT=runs/walk-quickstart;
  its `scripts/setup.sh` is replaced in the copy by a no-op (the copy uses this test run's environment, which
  scripts/setup.sh set up; run in the copy it would re-point the editable install at the copy);
- `bash scripts/test.sh` (the whole suite, which holds this test) is not run: the walk checks that the script
  exists and is what CI's .ci/run calls.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.process_group import run_group

REPO = Path(__file__).resolve().parents[1]
SKIP_MARK = re.compile(r"<!--\s*readme-walk:\s*(?P<kind>skip|check)\s*\((?P<reason>[^)]*)\)\s*-->")
WALK_CORPUS = ["Doyle_Lost_1912.txt", "Kipling_Light_1891.txt"]  # 0.8 MB of data/sample_corpus
SMALL_TRAIN = ["data.val_batches=1", "train.progress=false"]
STEPS_DIVISOR, DEFAULT_STEPS = 50, 2
EVAL_VAL_ROWS = 64

pytestmark = [pytest.mark.readme_walk, pytest.mark.slow]


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    text: str
    skip_reason: str | None
    check_reason: str | None = None  # train/launch commands only checked (see the module docstring)


def fenced_blocks(text: str, lang: str) -> list[tuple[int, str, list[str]]]:
    """(1-based line of the opening fence, the nearest non-blank line above it, the body's lines) of every ```lang
    block of a markdown text, in order."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == f"```{lang}":
            start, body = i, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            above = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            blocks.append((start + 1, above, body))
        i += 1
    return blocks


def readme_blocks(text: str) -> list[Block]:
    """The ```bash blocks of a markdown text, in order, each with the skip or check reason of a marker just above
    it."""
    blocks = []
    for line, above, body in fenced_blocks(text, "bash"):
        mark = SKIP_MARK.search(above)
        reason = {mark.group("kind"): mark.group("reason")} if mark else {}
        blocks.append(Block(line, "\n".join(body), reason.get("skip"), reason.get("check")))
    return blocks


def logical_lines(block: str) -> list[str]:
    """Commands of a block with backslash continuations joined."""
    out, pending = [], ""
    for line in block.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    if pending:
        out.append(pending)
    return out


def _strip_comment(line: str) -> str:
    return re.sub(r"\s+#\s.*$", "", line)


def _scaled_steps(match: re.Match) -> str:
    return f"train.steps={max(1, int(match.group(1)) // STEPS_DIVISOR)}"


def check_only(line: str) -> str | None:
    """A `megaloop train` or `megaloop launch --nproc-per-node N` command as a `megaloop check` of its config for its
    process count; None for any other command."""
    if not re.search(r"-m megaloop (train|launch)\b", line):
        return None
    line = _strip_comment(line)
    nproc = re.search(r"\s--nproc-per-node[= ](\d+)", line)
    world = f"WORLD_SIZE={nproc.group(1)} " if nproc else ""
    if nproc:
        line = line.replace(nproc.group(0), "")
    return world + re.sub(r"-m megaloop (train|launch)\b", "-m megaloop check", line)


def rewrite(line: str, places: dict[str, str], check: bool = False) -> str:
    """One README command as the walk runs it (see the module docstring); check: the block's check marker."""
    for name, value in places.items():
        line = re.sub(rf"\b{name}\b", value, line)
    if check and (checked := check_only(line)) is not None:
        return checked
    if re.search(r"\bbash scripts/test\.sh\b", line):
        return ("test -f scripts/test.sh && grep -q 'bash scripts/test.sh' .ci/run && "
                "echo 'readme-walk: scripts/test.sh is what .ci/run runs (not run here: it is the suite itself)'")
    if re.search(r"\bbash scripts/quickstart\.sh\b", line):
        args = " ".join([f"train.steps={DEFAULT_STEPS}", *SMALL_TRAIN])
        return f"OUT=runs/walk-quickstart CORPUS={places['TEXT_DIR']} {_strip_comment(line)} {args}"
    if re.search(r"-m megaloop eval\b", line) and "--val-rows" not in line:
        return f"{_strip_comment(line)} --val-rows {EVAL_VAL_ROWS}"
    if re.search(r"-m megaloop (train|launch)\b", line):
        line = _strip_comment(line)
        line = re.sub(r"train\.steps=(\d+)", _scaled_steps, line)
        extra = [] if "train.steps=" in line else [f"train.steps={DEFAULT_STEPS}"]
        return line + "".join(f" --set {o}" for o in extra + SMALL_TRAIN)
    return line


def _copy_working_tree(dest: Path) -> None:
    """Tracked and untracked-but-not-ignored files, as a fresh clone of this state would hold them."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        source = REPO / rel
        if source.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / rel)


def test_every_readme_bash_block_runs(tmp_path):
    venv = Path(sys.prefix)
    if not (venv / "bin" / "activate").is_file() or not (REPO / ".git").exists():
        pytest.skip("the walk needs a virtual environment (scripts/setup.sh makes .venv) and a git checkout")
    copy = tmp_path / "megaloop"
    copy.mkdir()
    _copy_working_tree(copy)
    (copy / ".venv").symlink_to(venv, target_is_directory=True)
    (copy / "scripts" / "setup.sh").write_text("#!/usr/bin/env bash\necho '[setup] readme-walk: the environment "
                                               "of the test run is used'\n")
    corpus = tmp_path / "text"
    corpus.mkdir()
    for name in WALK_CORPUS:
        shutil.copy(REPO / "data" / "sample_corpus" / name, corpus / name)
    places = {"TEXT_DIR": str(corpus), "TOK_DIR": str(tmp_path / "tok"), "SHARD_DIR": str(tmp_path / "shards")}

    blocks = readme_blocks((REPO / "README.md").read_text(encoding="utf-8"))
    assert blocks, "README.md has no ```bash block"
    script = ["set -euo pipefail",
              "trap 'echo \"readme-walk: FAILED (exit $?): $BASH_COMMAND\" >&2' ERR"]
    walked, skipped, checked = [], [], []
    for block in blocks:
        if block.skip_reason is not None:
            skipped.append(f"README.md:{block.line} ({block.skip_reason})")
            continue
        walked.append(block.line)
        if block.check_reason is not None:
            checked.append(f"README.md:{block.line} ({block.check_reason})")
        script.append(f"echo '### readme-walk: block at README.md:{block.line}'")
        for line in logical_lines(block.text):
            if line.strip():
                script += [f"echo '$ '{_shell_quote(line.strip())}",
                           rewrite(line, places, check=block.check_reason is not None)]
    for item in skipped:
        print(f"readme-walk: skipped the block at {item}")
    for item in checked:
        print(f"readme-walk: checked (not trained) the train/launch commands of the block at {item}")
    (tmp_path / "walk.sh").write_text("\n".join(script) + "\n")

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_PROCID", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    done = run_group(["bash", str(tmp_path / "walk.sh")], cwd=copy, env=env, capture_output=True, text=True,
                          timeout=900)
    log = done.stdout + done.stderr
    print("\n".join(line for line in log.splitlines() if line.startswith(("### ", "$ ", "megaloop", "readme-walk", "quickstart",
                                                                  "[setup]", "OK", "train:", "val:"))))
    print(f"readme-walk: walked the blocks at README.md lines {walked}")
    assert done.returncode == 0, f"a README command failed (rc {done.returncode}):\n{log[-6000:]}"
    assert "Traceback" not in log, log[-6000:]
    assert log.count("megaloop run:") >= 2, "the quickstart and the Usage block each print a run summary"


def _shell_quote(text: str) -> str:
    import shlex

    return shlex.quote(text)


def test_the_walk_rewrites_commands_as_documented():
    places = {"TEXT_DIR": "/c", "TOK_DIR": "/t", "SHARD_DIR": "/s"}
    assert rewrite("python -m data_prep inspect SHARD_DIR", places) == "python -m data_prep inspect /s"
    assert rewrite("python -m megaloop train x.yaml --set data.shards=SHARD_DIR --set train.steps=100", places) == \
        ("python -m megaloop train x.yaml --set data.shards=/s --set train.steps=2 --set data.val_batches=1 "
         "--set train.progress=false")
    assert rewrite("torchrun -m megaloop train x.yaml   # note", places).endswith(
        "x.yaml --set train.steps=2 --set data.val_batches=1 --set train.progress=false")
    assert "CORPUS=/c bash scripts/quickstart.sh train.steps=2" in rewrite("bash scripts/quickstart.sh  # 1.", places)
    assert rewrite("python -m megaloop launch --nproc-per-node 4 x.yaml --set train.steps=150", places).endswith(
        "x.yaml --set train.steps=3 --set data.val_batches=1 --set train.progress=false")
    assert "grep -q 'bash scripts/test.sh' .ci/run" in rewrite("bash scripts/test.sh   # 2.", places)
    assert rewrite("python -m megaloop eval runs/tiny --depths 1,2   # val loss", places) == \
        "python -m megaloop eval runs/tiny --depths 1,2 --val-rows 64"
    assert rewrite("python -m megaloop eval runs/tiny --val-rows 8", places) == \
        "python -m megaloop eval runs/tiny --val-rows 8"
    launch = "python -m megaloop launch --nproc-per-node 4 x.yaml --set data.shards=SHARD_DIR --set parallel.tp=2  # n"
    assert rewrite(launch, places, check=True) == \
        "WORLD_SIZE=4 python -m megaloop check x.yaml --set data.shards=/s --set parallel.tp=2"
    assert rewrite("python -m megaloop train x.yaml --set train.steps=150", places, check=True) == \
        "python -m megaloop check x.yaml --set train.steps=150"
    assert rewrite("python -m checkpoints inspect r", places, check=True) == "python -m checkpoints inspect r"
    text = "x\n<!-- readme-walk: skip (needs 2 nodes) -->\n\n```bash\nsrun a \\\n  b\n```\n```bash\nls\n```\n" \
        "<!-- readme-walk: check (tests run it) -->\n```bash\nls\n```\n"
    blocks = readme_blocks(text)
    assert [(b.line, b.skip_reason, b.check_reason) for b in blocks] == \
        [(4, "needs 2 nodes", None), (8, None, None), (12, None, "tests run it")]
    assert logical_lines(blocks[0].text) == ["srun a    b"]
