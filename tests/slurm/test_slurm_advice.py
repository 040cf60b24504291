"""Advice followed, at `python -m slurm`: each refusal that proposes a value or an option is followed as written,
and the job then renders (--dry-run) without a cluster."""
from __future__ import annotations

import re

import pytest

from slurm.cli import main
from tests.slurm.jobs import TINY

BASE = ["--nodes", "1", "--procs-per-node", "1", "--partition", "cpu", "--time", "1:00:00"]


def submit(tmp_path, *extra: str) -> list[str]:
    return ["submit", str(TINY), *BASE, "--out-root", str(tmp_path), "--no-check", *extra]


def refused(capsys, argv: list[str], code: int = 2) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("slurm: "), err
    return err


def replaced(argv: list[str], option: str, value: str) -> list[str]:
    i = argv.index(option)
    return argv[:i + 1] + [value] + argv[i + 2:]


def renders(capsys, argv: list[str]) -> str:
    assert main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_a_time_limit_shorter_than_the_stop_signal_each_proposal_renders(tmp_path, capsys):
    argv = replaced(submit(tmp_path, "--dry-run"), "--time", "5")  # 300 s, all of it the default signal lead
    err = refused(capsys, argv)
    found = re.search(r"raise --time to (\S+) or lower --signal-lead to (\d+)$", err)
    assert found, err
    time, lead = found.groups()
    assert "#SBATCH --time=" + time in renders(capsys, replaced(argv, "--time", time))
    assert "@" + lead in renders(capsys, argv + ["--signal-lead", lead])


def test_a_time_limit_too_short_for_any_lead_is_only_told_to_grow(tmp_path, capsys):
    argv = replaced(submit(tmp_path, "--dry-run"), "--time", "1")
    err = refused(capsys, argv)
    assert "--signal-lead" not in err.split(";")[-1], err  # no lead leaves 120 s of a 60 s job
    time = re.search(r"raise --time to (\S+)$", err).group(1)
    renders(capsys, replaced(argv, "--time", time))


@pytest.mark.parametrize("option, bad", [("--time", "an hour"), ("--dependency", "after 12")])
def test_slurm_syntax_the_refusal_shows_is_accepted(tmp_path, capsys, option, bad):
    argv = submit(tmp_path, "--dry-run", option, bad) if option == "--dependency" else \
        replaced(submit(tmp_path, "--dry-run"), option, bad)
    err = refused(capsys, argv)
    examples = re.search(r"e\.g\. ([^)]+)\)?$", err).group(1)
    for example in re.split(r", | or ", examples):
        assert f"--{option[2:]}={example}" in renders(capsys, replaced(argv, option, example))


def test_a_set_without_a_key_takes_the_shape_of_the_examples(tmp_path, capsys):
    argv = submit(tmp_path, "--dry-run", "--set", "steps=5")
    err = refused(capsys, argv)
    examples = re.search(r"e\.g\. (\S+) or (\S+)$", err).groups()
    for example in examples:
        assert example in renders(capsys, replaced(argv, "--set", example))


def test_without_sbatch_the_dry_run_it_proposes_prints_the_script(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # a machine that is not a Slurm login node
    argv = submit(tmp_path)
    err = refused(capsys, argv, code=1)
    option = re.search(r"\((--[\w-]+) prints the script\)", err).group(1)
    assert renders(capsys, argv + [option]).startswith("#!")
    assert not any(tmp_path.rglob("*.sbatch"))  # the refused submission left no script behind


def test_a_config_megaloop_refuses_for_the_job_is_submitted_with_no_check(tmp_path, capsys):
    argv = ["submit", str(TINY), *BASE, "--out-root", str(tmp_path), "--set", "parallel.dp=2"]
    err = refused(capsys, argv)  # megaloop check: 1 process, dp=2
    assert "megaloop refuses it for 1 processes" in err, err
    option = re.search(r"\((--[\w-]+) submits anyway\)", err).group(1)
    assert renders(capsys, argv + [option, "--dry-run"]).startswith("#!")


def test_a_sweep_that_sets_a_point_key_leaves_it_out(tmp_path, capsys):
    sweep = ["sweep", str(TINY), *BASE, "--out-root", str(tmp_path), "--no-check", "--dry-run", "--mu-rec", "2",
             "--flops", "1e13"]
    err = refused(capsys, sweep + ["--set", "train.steps=9"])
    assert "is set by the sweep for each point; leave it out" in err, err
    assert "#SBATCH --array=0-0" in renders(capsys, sweep)


def test_a_budget_below_one_step_is_raised_to_the_value_named(tmp_path, capsys):
    sweep = ["sweep", str(TINY), *BASE, "--out-root", str(tmp_path), "--no-check", "--dry-run", "--mu-rec", "2,4",
             "--flops", "1e9"]
    err = refused(capsys, sweep)
    budget = re.search(r"raise the budget to (\S+) or more$", err).group(1)
    text = renders(capsys, replaced(sweep, "--flops", budget))
    assert "#SBATCH --array=0-1" in text and "train.steps=1" in text
