"""Advice followed, at `python -m megaloop plan`: a job size the config does not fit is refused with the settings
that fit it, and the plan is then made with exactly those settings."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from megaloop.__main__ import main
from megaloop.config import ConfigError, load_config
from megaloop.plan.layout import resolve_layout

TINY = str(Path(__file__).resolve().parents[2] / "configs/parcae-tiny.yaml")
JOB = ["--gpu", "h100", "--nodes", "1", "--gpus-per-node", "2", "--json"]


def plan(capsys, *sets: str) -> tuple[int, str]:
    code = main(["plan", TINY, *JOB, *[a for s in sets for a in ("--set", s)]])
    out = capsys.readouterr()
    return code, out.err.strip() if code else out.out


@pytest.mark.parametrize("phrase", ["; set ", "(or "])
def test_a_dp_that_does_not_fit_the_job_is_planned_with_the_one_proposed(capsys, phrase):
    code, err = plan(capsys, "parallel.dp=3")
    assert code == 2 and "\n" not in err, err
    fix = re.match(r"(parallel\.dp=\w+)", err.split(phrase, 1)[1]).group(1)
    code, out = plan(capsys, "parallel.dp=3", fix)
    assert code == 0 and '"dp": 2' in out, out


def test_the_layout_refusals_of_the_planner_api_propose_what_resolves():
    cfg = load_config(TINY, ["parallel.dp=3"], validate=False)  # the planner's own check, past load_config's
    with pytest.raises(ConfigError) as refused:
        resolve_layout(cfg, 2)
    fixes = re.search(r"use parallel\.dp=(\d+) or leave it null", str(refused.value))
    assert fixes, refused.value
    for dp in (fixes.group(1), "null"):
        assert resolve_layout(load_config(TINY, [f"parallel.dp={dp}"], validate=False), 2).dp == 2
    cfg = load_config(TINY, ["parallel.tp=3"], validate=False)
    with pytest.raises(ConfigError) as refused:
        resolve_layout(cfg, 4)
    fits = re.search(r"tp values that fit: \[([\d, ]+)\]", str(refused.value)).group(1).split(", ")
    assert fits == ["1", "2", "4"], refused.value
    for tp in fits:
        assert resolve_layout(load_config(TINY, [f"parallel.tp={tp}"], validate=False), 4).tp == int(tp)
