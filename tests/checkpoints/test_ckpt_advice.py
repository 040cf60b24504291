"""Advice followed, at `python -m checkpoints`: each refusal that proposes a path, an option or a command is followed
as it is written, and the command then succeeds."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
import torch
from ckpt_helpers import fast_write

from checkpoints import Checkpointer, CheckpointError, CheckpointReader, Piece, find_checkpoints
from checkpoints.cli import main
from megaloop.config import load_config
from megaloop.model import build_model
from megaloop.model.convert import to_reference_state_dict

REPO = Path(__file__).resolve().parents[2]
TINY = "configs/parcae-tiny.yaml"


@pytest.fixture(scope="module")
def official(tmp_path_factory) -> Path:
    """Official-layout weights (.pt) of configs/parcae-tiny.yaml as it stands."""
    cfg = load_config(REPO / TINY, [])
    ref = to_reference_state_dict(build_model(cfg.model, seed=0).state_dict(), cfg.model)
    path = tmp_path_factory.mktemp("official") / "parcae.pt"
    torch.save({**ref, "lm_head.weight": ref["transformer.wte.weight"]}, path)
    return path


def save(root: Path, step: int = 3, extra: str | None = None) -> Path:
    """A committed checkpoint of the tiny model (model/* arrays and the config, as training writes them), with an
    `extra` model array where given (a parameter the official model does not have)."""
    cfg = load_config(REPO / TINY, ["model.vocab_size=512", "model.seq_len=32"])
    model = build_model(cfg.model, seed=0)
    pieces = [Piece(f"model/{n}", tuple(p.shape), (0,) * p.dim(), p.detach()) for n, p in model.named_parameters()]
    pieces += [Piece(f"model/{extra}", (4,), (0,), torch.ones(4))] if extra else []
    with Checkpointer(root, async_save=False, file_writer=fast_write) as saver:
        saver.save(step, pieces, {"config": cfg.to_dict(), "tokens": 100})
        assert saver.wait().ok
    return root / f"step_{step:08d}"


def refused(capsys, *argv) -> str:
    """The one-line error of a refused command (exit code 2)."""
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err


def megaloop_check_into(command: str, cwd: Path, **given: str) -> Path:
    """Run `python -m megaloop check ... > FILE` as a message shows it (placeholders replaced by `given`), in cwd."""
    from megaloop.__main__ import main as megaloop_main

    argv, target = shlex.split(command.split(">")[0]), command.split(">")[1].strip()
    assert argv[:4] == ["python", "-m", "megaloop", "check"], command
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert megaloop_main([given.get(a, a) for a in argv[3:]]) == 0
    (cwd / target).write_text(out.getvalue())
    return cwd / target


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_a_wrong_directory_is_replaced_by_the_kinds_the_refusal_names(tmp_path, capsys, command):
    step = save(tmp_path / "run")
    err = refused(capsys, command, tmp_path / "nope")
    assert "give a checkpoint directory or the root holding 'latest'" in err, err
    assert main([command, str(tmp_path / "run")]) == 0  # the root
    (tmp_path / "empty").mkdir()
    err = refused(capsys, command, tmp_path / "empty")
    assert "give a step_XXXXXXXX directory or the root that holds 'latest'" in err, err
    assert main([command, str(step)]) == 0


def test_export_to_a_path_without_the_suffix_ends_it_in_safetensors(tmp_path, capsys):
    step = save(tmp_path / "run")
    err = refused(capsys, "export", step, "--out", tmp_path / "weights.bin")
    assert "give an --out path ending in .safetensors" in err, err
    assert main(["export", str(step), "--out", str(tmp_path / "weights.safetensors")]) == 0


def test_export_to_a_directory_writes_the_file_the_refusal_names(tmp_path, capsys):
    step = save(tmp_path / "run")
    (tmp_path / "out.safetensors").mkdir()
    err = refused(capsys, "export", step, "--out", tmp_path / "out.safetensors")
    named = re.search(r"give a file path such as (\S+)$", err).group(1)
    assert main(["export", str(step), "--out", named]) == 0 and Path(named).is_file()


def test_export_over_an_earlier_one_takes_another_out(tmp_path, capsys):
    step = save(tmp_path / "run")
    assert main(["export", str(step), "--out", str(tmp_path / "a.safetensors")]) == 0
    err = refused(capsys, "export", step, "--out", tmp_path / "a.safetensors")
    assert "give another --out, or pass --overwrite" in err, err  # --overwrite: test_convert_export.py
    assert main(["export", str(step), "--out", str(tmp_path / "b.safetensors")]) == 0


@pytest.mark.parametrize("given", ["none", "yaml", "not json", "no model"])
def test_convert_without_a_json_config_runs_the_megaloop_check_it_shows(official, tmp_path, capsys, given):
    config = {"yaml": REPO / TINY, "not json": tmp_path / "c.json", "no model": tmp_path / "c.json"}.get(given)
    if given == "not json":
        config.write_text("model: {}\n")
    if given == "no model":
        config.write_text('{"train": {}}')
    argv = ["convert", "--from-official", official, "--out", tmp_path / "ckpt"]
    err = refused(capsys, *argv, *(["--config", config] if config else []))
    command = re.search(r"`(python -m megaloop check [^`]*)`", err).group(1)
    if ">" not in command:  # "give the output of `python -m megaloop check CONFIG`"
        command += " > config.json"
    written = megaloop_check_into(command, tmp_path, CONFIG=TINY)
    assert main([str(a) for a in argv] + ["--config", str(written)]) == 0
    assert CheckpointReader(find_checkpoints(tmp_path / "ckpt")[0]).metadata["source"] == "official"


def test_convert_into_a_used_directory_takes_a_new_one(official, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # the command a refusal shows is relative to the repository
    config = megaloop_check_into(f"python -m megaloop check {TINY} > config.json", tmp_path)
    save(tmp_path / "run")
    argv = ["convert", "--from-official", official, "--config", config]
    assert "give a new directory" in refused(capsys, *argv, "--out", tmp_path / "run")
    assert main([str(a) for a in argv] + ["--out", str(tmp_path / "new")]) == 0


def test_to_official_with_from_official_options_drops_them(tmp_path, capsys):
    step = save(tmp_path / "run")
    err = refused(capsys, "convert", "--to-official", step, "--out", tmp_path / "w.pt", "--step", "3")
    assert "drop them with --to-official" in err, err
    assert main(["convert", "--to-official", str(step), "--out", str(tmp_path / "w.pt")]) == 0


@pytest.mark.parametrize("out, fixed", [("w.npz", "w.pt"), ("w.npz", "w.safetensors"), ("dir.pt", "dir.pt/w.pt")])
def test_to_official_output_takes_the_kind_of_file_named(tmp_path, capsys, out, fixed):
    step = save(tmp_path / "run")
    if out == "dir.pt":
        (tmp_path / out).mkdir()
    err = refused(capsys, "convert", "--to-official", step, "--out", tmp_path / out)
    assert ("name the file .pt/.pth (torch.save) or .safetensors" in err if out.endswith(".npz") else
            "give the path of the file to write" in err), err
    assert main(["convert", "--to-official", str(step), "--out", str(tmp_path / fixed)]) == 0


def test_a_checkpoint_with_unofficial_parameters_is_exported_with_the_command_named(tmp_path, capsys):
    step = save(tmp_path / "run", extra="core.0.gate.weight")
    err = refused(capsys, "convert", "--to-official", step, "--out", tmp_path / "w.pt")
    command = re.search(r"export them with `python -m checkpoints (export)` instead", err)
    assert command, err
    assert main([command.group(1), str(step), "--out", str(tmp_path / "all.safetensors")]) == 0


def test_an_uncommitted_directory_is_replaced_by_one_find_checkpoints_gives(tmp_path):
    step = save(tmp_path / "run")
    (step / "COMMIT").unlink()
    save(tmp_path / "run", step=2)
    with pytest.raises(CheckpointError, match=r"use a committed checkpoint, e.g. from find_checkpoints\(root\)"):
        CheckpointReader(step)
    assert CheckpointReader(find_checkpoints(tmp_path / "run")[0]).step == 2
