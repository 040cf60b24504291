"""Advice followed, at `python -m data_prep`: each refusal's "What to do" is read, the command line is changed the
way it says, and the command then succeeds (or, for a chain, fails with a different error that is followed too)."""
from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

from data_prep.cli import main

CHAPTERS = 4


@pytest.fixture(scope="module")
def made(shared_dir, tmp_path_factory) -> Path:
    """root/corpus (4 chapters), root/tok (vocab 300), root/shards (seq_len 32) made by the command line itself."""
    root = tmp_path_factory.mktemp("advice_data")
    (root / "corpus").mkdir()
    for f in sorted((shared_dir / "data" / "corpus" / "chapters").glob("*.txt"))[:CHAPTERS]:
        shutil.copy(f, root / "corpus" / f.name)
    assert main(["tokenizer", "--input", str(root / "corpus"), "--output", str(root / "tok"), "--vocab-size", "300",
                 "--quiet"]) == 0
    assert main(shards_args(root, root / "shards")) == 0
    return root


def shards_args(root: Path, out: Path, *extra: str) -> list[str]:
    return ["shards", "--input", str(root / "corpus"), "--tokenizer", str(root / "tok"), "--output", str(out),
            "--seq-len", "32", "--workers", "1", "--quiet", *extra]


def tokenizer_args(root: Path, out: Path, *extra: str) -> list[str]:
    return ["tokenizer", "--input", str(root / "corpus"), "--output", str(out), "--vocab-size", "300", "--quiet",
            *extra]


def refused(capsys, argv: list[str]) -> str:
    """The 'What to do' of the one-line error a refused command prints (exit code 2)."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "What to do: " in err, err
    return err.split("What to do: ", 1)[1]


def with_option(argv: list[str], flag: str, value: str | None = None) -> list[str]:
    """argv with `flag` set to `value` (replacing a value it had), or added as a switch when value is None."""
    if flag in argv and value is not None:
        i = argv.index(flag)
        return argv[:i + 1] + [value] + argv[i + 2:]
    return argv + [flag] + ([value] if value is not None else [])


def without_option(argv: list[str], flag: str) -> list[str]:
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:]


def passed_value(advice: str) -> tuple[str, str]:
    """`pass [e.g. ]--flag VALUE` -> (--flag, VALUE)."""
    found = re.search(r"pass (?:e\.g\. )?(--[\w-]+) (\d[\d.]*)", advice)
    assert found, advice
    return found.groups()


@pytest.mark.parametrize("command, flag, bad", [
    ("tokenizer", "--vocab-size", "100"),
    ("shards", "--val-fraction", "1.5"),
    ("shards", "--max-invalid-fraction", "2"),
    ("shards", "--workers", "0"),
    ("inspect", "--sample-tokens", "-1"),
])
def test_a_value_the_refusal_passes_is_accepted(made, tmp_path, capsys, command, flag, bad):
    argv = {"tokenizer": tokenizer_args(made, tmp_path / "tok"), "shards": shards_args(made, tmp_path / "s"),
            "inspect": ["inspect", str(made / "shards"), "--quiet"]}[command]
    argv = with_option(argv, flag, bad)
    given, value = passed_value(refused(capsys, argv))
    assert given == flag
    assert main(with_option(argv, flag, value)) == 0  # the advice, followed


def test_vocab_sizes_the_refusal_names_train(made, tmp_path, capsys):
    argv = with_option(tokenizer_args(made, tmp_path / "tok"), "--vocab-size", str((1 << 24) + 1))
    advice = refused(capsys, argv)
    sizes = re.findall(r"(?:such as|or) (\d+)", advice)
    assert sizes == ["32768", "4096"], advice
    for size in sizes:
        assert main(with_option(argv, "--vocab-size", size) + ["--overwrite"]) == 0


def test_min_frequency_refusal_passes_a_value_that_trains(made, tmp_path, capsys):
    argv = with_option(tokenizer_args(made, tmp_path / "tok"), "--min-frequency", "-1")
    value = re.match(r"pass (\d+)", refused(capsys, argv)).group(1)
    assert main(with_option(argv, "--min-frequency", value)) == 0


def test_max_bytes_refusal_leaves_the_option_out(made, tmp_path, capsys):
    argv = with_option(tokenizer_args(made, tmp_path / "tok"), "--max-bytes", "0")
    assert "leave --max-bytes out" in refused(capsys, argv)
    assert main(without_option(argv, "--max-bytes")) == 0


@pytest.mark.parametrize("command", ["tokenizer", "shards"])
def test_an_output_in_use_takes_another_output_or_overwrite(made, tmp_path, capsys, command):
    make = tokenizer_args if command == "tokenizer" else shards_args
    used = made / ("tok" if command == "tokenizer" else "shards")
    copy = tmp_path / "used"
    shutil.copytree(used, copy)
    argv = make(made, copy)
    advice = refused(capsys, argv)
    assert "choose another --output or pass --overwrite" in advice, advice
    assert main(with_option(argv, "--output", str(tmp_path / "another"))) == 0
    assert main(with_option(argv, "--overwrite")) == 0


@pytest.mark.parametrize("command", ["tokenizer", "shards"])
def test_an_output_that_is_a_file_takes_a_directory(made, tmp_path, capsys, command):
    make = tokenizer_args if command == "tokenizer" else shards_args
    (tmp_path / "file").write_text("x")
    argv = make(made, tmp_path / "file")
    assert "pass a directory for --output (it is created when missing)" in refused(capsys, argv)
    assert main(with_option(argv, "--output", str(tmp_path / "missing" / "dir"))) == 0


def test_a_single_document_corpus_passes_val_fraction_zero(made, tmp_path, capsys):
    (tmp_path / "one").mkdir()
    shutil.copy(sorted((made / "corpus").iterdir())[0], tmp_path / "one")
    argv = with_option(shards_args(made, tmp_path / "s"), "--input", str(tmp_path / "one"))
    flag, value = passed_value(refused(capsys, argv))
    assert (flag, value) == ("--val-fraction", "0")
    assert main(with_option(argv, flag, value)) == 0


def test_rows_longer_than_the_text_get_further_each_way_the_refusal_names(made, tmp_path, capsys):
    # a chapter holds ~16k tokens; stream packing refuses (best fit makes one padded row of any text)
    argv = with_option(shards_args(made, tmp_path / "s", "--packing", "stream"), "--seq-len", "60000")
    advice = refused(capsys, argv)
    assert "lower --seq-len" in advice and "pass --keep-last-partial" in advice, advice
    assert main(argv + ["--keep-last-partial"]) == 0
    assert main(with_option(argv, "--seq-len", "32") + ["--overwrite"]) == 0


def test_a_tokenizer_directory_without_a_tokenizer_is_filled_by_the_command_named(made, tmp_path, capsys):
    (tmp_path / "tok").mkdir()
    argv = with_option(shards_args(made, tmp_path / "s"), "--tokenizer", str(tmp_path / "tok"))
    advice = refused(capsys, argv)
    assert re.search(r"pass the directory written by `python -m data_prep tokenizer`", advice), advice
    assert main(tokenizer_args(made, tmp_path / "tok")) == 0  # the named command, writing that directory
    assert main(argv) == 0


def test_an_input_that_does_not_exist_asks_for_an_existing_one(made, tmp_path, capsys):
    argv = with_option(shards_args(made, tmp_path / "s"), "--input", str(tmp_path / "nope"))
    assert "pass --input an existing file, directory or glob" in refused(capsys, argv)
    assert main(with_option(argv, "--input", str(made / "corpus"))) == 0


def test_inspect_of_a_directory_without_manifest_runs_the_shards_command_again(made, tmp_path, capsys):
    shutil.copytree(made / "shards", tmp_path / "s")
    (tmp_path / "s" / "manifest.json").unlink()  # an interrupted `shards`: everything but the manifest
    advice = refused(capsys, ["inspect", str(tmp_path / "s"), "--quiet"])
    assert "`python -m data_prep shards`" in advice and "run the command again, with --overwrite" in advice, advice
    assert main(shards_args(made, tmp_path / "s", "--overwrite")) == 0  # the shards left there need --overwrite
    assert main(["inspect", str(tmp_path / "s"), "--quiet"]) == 0


def test_inspect_of_an_unreadable_manifest_re_creates_the_shards(made, tmp_path, capsys):
    shutil.copytree(made / "shards", tmp_path / "s")
    (tmp_path / "s" / "manifest.json").write_text("{not json")
    assert refused(capsys, ["inspect", str(tmp_path / "s"), "--quiet"]).startswith("re-create the shards")
    advice = refused(capsys, shards_args(made, tmp_path / "s"))  # re-creating into the same place: a new refusal
    assert "pass --overwrite" in advice, advice
    assert main(shards_args(made, tmp_path / "s", "--overwrite")) == 0
    assert main(["inspect", str(tmp_path / "s"), "--quiet"]) == 0


def test_inspect_with_a_tokenizer_that_is_not_a_directory_leaves_it_out(made, capsys):
    argv = ["inspect", str(made / "shards"), "--quiet", "--tokenizer", str(made / "nope")]
    assert "leave --tokenizer out" in refused(capsys, argv)
    assert main(without_option(argv, "--tokenizer")) == 0


def test_inspect_with_another_tokenizer_uses_the_copy_the_advice_names(made, tmp_path, capsys):
    assert main(with_option(tokenizer_args(made, tmp_path / "other"), "--vocab-size", "280")) == 0
    capsys.readouterr()
    assert main(["inspect", str(made / "shards"), "--quiet", "--tokenizer", str(tmp_path / "other")]) == 1
    out = capsys.readouterr().out
    copy = re.search(r"use the tokenizer the shards were made with \(a copy is in (SHARD_DIR/\w+)\)", out)
    assert copy, out
    tokenizer = copy.group(1).replace("SHARD_DIR", str(made / "shards"))
    assert main(["inspect", str(made / "shards"), "--quiet", "--tokenizer", tokenizer]) == 0


def test_mpi_without_mpi4py_runs_without_mpi(made, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # an environment without mpi4py: importing it fails
    argv = shards_args(made, tmp_path / "s", "--mpi", "on")
    assert "or run without --mpi" in refused(capsys, argv)
    assert main(without_option(argv, "--mpi")) == 0


def test_a_manifest_of_another_format_re_creates_the_shards_with_this_version(made, tmp_path, capsys):
    import json

    shutil.copytree(made / "shards", tmp_path / "s")
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    manifest["format_version"] = -1
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(manifest))
    assert "re-create the shards with this version of data_prep" in refused(capsys, ["inspect", str(tmp_path / "s"),
                                                                                     "--quiet"])
    assert main(shards_args(made, tmp_path / "s", "--overwrite")) == 0
    assert main(["inspect", str(tmp_path / "s"), "--quiet"]) == 0


@pytest.mark.parametrize("damage", ["no BPE vocabulary", "no special tokens"])
def test_a_damaged_tokenizer_is_trained_again_as_told(made, tmp_path, capsys, damage):
    import json

    shutil.copytree(made / "tok", tmp_path / "tok")
    content = json.loads((tmp_path / "tok" / "tokenizer.json").read_text())
    if damage == "no BPE vocabulary":
        del content["model"]["vocab"]
    else:
        content["added_tokens"] = []
        content["model"]["vocab"] = {t: i for t, i in content["model"]["vocab"].items() if not t.startswith("<|")}
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(content))
    argv = with_option(shards_args(made, tmp_path / "s"), "--tokenizer", str(tmp_path / "tok"))
    advice = refused(capsys, argv)  # the tokenizer's own checksum sees the edit first
    assert "re-train the tokenizer" in advice or "`python -m data_prep tokenizer`" in advice, advice
    assert main(tokenizer_args(made, tmp_path / "tok", "--overwrite")) == 0  # re-trained, over the damage
    assert main(argv) == 0


def test_shards_without_member_offsets_are_reindexed_as_the_refusal_says(made, tmp_path, capsys):
    """A manifest of format version 1 (no member offsets) is refused with a command; running that command rewrites
    the manifest to exactly what `shards` writes today, and the loader then reads the same rows."""
    import json

    from data_prep.loader import ShardLoader

    shutil.copytree(made / "shards", tmp_path / "s")
    path = tmp_path / "s" / "manifest.json"
    written = path.read_bytes()
    old = json.loads(written)
    old["format_version"] = 1
    for split in old["splits"].values():
        for entry in split["shards"]:
            del entry["data_offset"], entry["stride"]
    path.write_text(json.dumps(old))
    advice = refused(capsys, ["inspect", str(tmp_path / "s"), "--quiet"])
    command = re.search(r"`python -m data_prep (reindex [^`]*)`", advice).group(1).split()
    assert main(command) == 0 and path.read_bytes() == written
    assert main(command) == 0 and "nothing to do" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "s"), "--quiet"]) == 0
    loader = ShardLoader(tmp_path / "s", 4, prefetch=0)
    again = ShardLoader(made / "shards", 4, prefetch=0)
    assert loader.batch(3)["tokens"].equal(again.batch(3)["tokens"])
