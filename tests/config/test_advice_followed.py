"""Advice followed, at the config: each refusal that proposes settings is followed by applying exactly the settings
it names, and the config then loads (or, for a chain, the next refusal is followed the same way)."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from megaloop.config import ConfigError, load_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "parcae-tiny.yaml"
SETTING = re.compile(r"\b((?:model|parallel|optim|train|data|checkpoint)\.[a-z_A-Z]+)(=|\s*[<>]=\s*)([\w.-]+)")
REPO = TINY.parents[1]


def proposed(message: str, after: str) -> list[str]:
    """The key=value settings the message proposes after the phrase `after`, up to an ` or ` that starts an
    alternative (`key <= N`, `key >= N` propose N)."""
    first = re.split(r",? or ", message.split(after, 1)[1])[0]  # of alternatives, the first
    return [f"{key}={value}" for key, _, value in SETTING.findall(first)]


DEEPSPEED_CANNOT = ["parallel.engine=deepspeed", "parallel.zero_stage=0", "train.precision=fp64", "parallel.tp=2",
                    "parallel.dp_balance=depth", "checkpoint.every=5", "checkpoint.resume=somewhere"]


@pytest.mark.parametrize("overrides, world, phrases", [
    (["model.arch=gpt"], None, ["set "]),  # every gpt setting at once, not one refusal after another
    (["model.injection=concat"], None, ["set "]),
    (["model.injection=concat"], None, [", or "]),  # keep parcae, with its own injection
    (["model.injection=none"], None, ["set "]),
    (["model.arch=rdm", "model.injection=none"], None, ["set "]),  # rdm has one injection: not a list to pick from
    (["model.arch=rdm"], None, ["set "]),
    (["parallel.zero_stage=2"], 2, ["use ", "; set "]),  # deepspeed for ZeRO-2, then what deepspeed cannot run
    (["parallel.zero_offload=true"], 2, ["under ", "; set "]),
    (["parallel.pp=8"], 2, ["use "]),
    (["parallel.engine=deepspeed", "optim.name=adamw", "parallel.pp=2"], 2, ["(or "]),
    (["parallel.engine=deepspeed", "optim.name=adamw", "parallel.pp=2"], 2, ["use "]),
    (DEEPSPEED_CANNOT, 2, ["; set "]),  # every setting DeepSpeed cannot run, named and fixed at once
    (DEEPSPEED_CANNOT, 2, ["or use "]),
    (["data.global_batch_size=12"], None, ["set e.g. "]),
    (["parallel.dp=2"], 1, ["or set "]),  # a plain single process: train in it
    (["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "data.micro_batch_size=4"], 1, ["or set "]),
    (["parallel.dp=3"], 2, ["; set "]),
    (["parallel.dp=3"], 2, ["(or "]),
])
def test_config_refusals_propose_settings_that_load(overrides, world, phrases):
    settings = list(overrides)
    for phrase in phrases:
        with pytest.raises(ConfigError) as refused:
            load_config(str(TINY), settings, world_size=world)
        fix = proposed(str(refused.value), phrase)
        assert fix, refused.value
        settings += fix
    load_config(str(TINY), settings, world_size=world)  # the advice, followed: it loads


@pytest.mark.parametrize("given,expected", [("model.seq_len=64", "model.seq_len=32"),
                                            ("model.vocab_size=300", "model.vocab_size=512")])
def test_what_the_shards_need_is_proposed_and_loads(tiny_shards, given, expected):
    """The shards hold 33-token rows of a 512-token vocabulary: a model that does not fit them is told the value."""
    settings = [f"data.shards={tiny_shards}", "model.vocab_size=512", "model.seq_len=32", given]
    with pytest.raises(ConfigError) as refused:
        load_config(str(TINY), settings)
    settings += proposed(str(refused.value), "; set ")
    assert settings[-1] == expected
    key, value = expected.split("=")
    assert getattr(load_config(str(TINY), settings).model, key.split(".")[1]) == int(value)


def test_too_few_micro_batches_for_the_pipeline_each_proposal_loads():
    settings = ["parallel.pp=2", "data.micro_batch_size=16"]
    with pytest.raises(ConfigError) as refused:
        load_config(str(TINY), settings, world_size=2)
    fixes = [proposed(str(refused.value), phrase) for phrase in ("; use ", "_size=8 or ")]
    assert fixes == [["data.micro_batch_size=8"], ["data.global_batch_size=32"]], refused.value
    for fix in fixes:  # alternatives: either one alone is enough
        assert load_config(str(TINY), settings + fix, world_size=2).parallel.pp == 2


def test_tp_values_that_fit_the_job_load():
    with pytest.raises(ConfigError) as refused:
        load_config(str(TINY), ["parallel.tp=2"], world_size=3)
    listed = re.search(r"tp values that fit this job and the model's heads: \[([\d, ]+)\]", str(refused.value))
    assert listed, refused.value
    for tp in listed.group(1).split(", "):
        settings = [f"parallel.tp={tp}"]
        try:
            load_config(str(TINY), settings, world_size=3)
        except ConfigError as then:  # a 3-way job needs another batch size: that advice, followed too
            settings += proposed(str(then), "set e.g. ")
        assert load_config(str(TINY), settings, world_size=3).parallel.tp == int(tp)


def test_a_misspelt_key_is_loaded_under_the_name_it_suggests():
    with pytest.raises(ConfigError) as refused:
        load_config(str(TINY), ["train.step=10"])
    name = re.search(r"did you mean '(\w+)'", str(refused.value)).group(1)
    assert load_config(str(TINY), [f"train.{name}=10"]).train.steps == 10


def test_a_value_that_is_not_yaml_loads_quoted_as_the_example_shows():
    with pytest.raises(ConfigError) as refused:  # `--set train.val_depths=[1, 4]` unquoted: the shell split it
        load_config(str(TINY), ["train.val_depths=[1,"])
    example = re.search(r"e\.g\. (--set .+)$", str(refused.value)).group(1)
    flag, setting = shlex.split(example)
    assert flag == "--set" and load_config(str(TINY), [setting]).train.val_depths == [1, 4]


def test_an_override_without_a_value_takes_the_shape_of_the_example():
    with pytest.raises(ConfigError) as refused:
        load_config(str(TINY), ["train.steps"])
    example = re.search(r"e\.g\. (\S+)$", str(refused.value)).group(1)
    assert load_config(str(TINY), [example]).train.steps == 100


@pytest.mark.parametrize("make", ["directory", "empty"])
def test_an_unusable_config_file_is_replaced_by_the_one_named(tmp_path, make):
    path = tmp_path / "config.yaml"
    path.mkdir() if make == "directory" else path.write_text("# nothing yet\n")
    with pytest.raises(ValueError) as refused:
        load_config(str(path), [])
    named = re.search(r"(configs/[\w.-]+\.yaml)", str(refused.value)).group(1)
    assert load_config(str(REPO / named), []).model.arch == "parcae"


def run_data_prep(command: str, **given: Path) -> int:
    """Run a `python -m data_prep ...` command a message shows, its UPPERCASE placeholders replaced by `given`."""
    from data_prep.cli import main

    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "data_prep"], command
    return main([str(given.get(a, a)) for a in argv[3:]] + ["--seq-len", "32", "--quiet"])


def test_a_directory_without_shards_is_made_by_the_command_shown(tiny_shards, tmp_path, capsys):
    settings = [f"data.shards={tmp_path / 'shards'}", "model.vocab_size=512", "model.seq_len=32"]
    with pytest.raises(ConfigError) as refused:
        load_config(str(TINY), settings)
    command = re.search(r"create one with `([^`]+)`", str(refused.value)).group(1)
    root = tiny_shards.parent
    assert run_data_prep(command, TEXT_DIR=root / "corpus", TOK_DIR=root / "tok", DIR=tmp_path / "shards") == 0
    assert load_config(str(TINY), settings).data.shards == str(tmp_path / "shards")


def test_an_unreadable_manifest_is_re_made_by_the_command_shown(tiny_shards, tmp_path, capsys):
    from data_prep.cli import main

    shards = tmp_path / "shards"
    root = tiny_shards.parent
    args = ["--input", str(root / "corpus"), "--tokenizer", str(root / "tok"), "--output", str(shards)]
    assert main(["shards", *args, "--seq-len", "32", "--quiet"]) == 0
    (shards / "manifest.json").write_text("{cut short")
    settings = [f"data.shards={shards}", "model.vocab_size=512", "model.seq_len=32"]
    with pytest.raises(ConfigError) as refused:
        load_config(str(TINY), settings)
    command = re.search(r"re-create the shards with `([^`]+)`", str(refused.value)).group(1)
    assert run_data_prep(f"{command} {shlex.join(args)}") == 2  # the shards are still there ...
    assert "pass --overwrite" in capsys.readouterr().err
    assert run_data_prep(f"{command} {shlex.join(args)} --overwrite") == 0  # ... and that advice gets through
    assert json.loads((shards / "manifest.json").read_text())["seq_len"] == 32
    assert load_config(str(TINY), settings).data.shards == str(shards)


@pytest.mark.parametrize("asked", ["parallel.zero_stage=2", "parallel.zero_offload=true"])
def test_the_native_engine_is_not_proposed_for_what_only_deepspeed_runs(asked):
    settings = ["parallel.engine=deepspeed", asked]
    with pytest.raises(ConfigError) as refused:
        load_config(str(TINY), settings, world_size=2)
    assert "parallel.engine=native" not in str(refused.value)  # it would be refused for `asked`
    with pytest.raises(ConfigError, match="deepspeed only|native engine runs ZeRO stage 0 or 1"):
        load_config(str(TINY), settings + ["parallel.engine=native"], world_size=2)
