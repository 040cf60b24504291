"""Advice followed, at the config: each refusal that proposes settings is followed by applying exactly the settings
it names, and the config then loads (or, for a chain, the next refusal is followed the same way)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from megaloop.config import ConfigError, load_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "parcae-tiny.yaml"
SETTING = re.compile(r"\b((?:model|parallel|optim|train|data|checkpoint)\.[a-z_A-Z]+)(=|\s*<=\s*)([\w.-]+)")


def proposed(message: str, after: str) -> list[str]:
    """The key=value settings the message proposes after the phrase `after` (`key <= N` proposes N)."""
    return [f"{key}={value}" for key, _, value in SETTING.findall(message.split(after, 1)[1])]


@pytest.mark.parametrize("overrides, world, phrases", [
    (["model.arch=gpt"], None, ["set "]),  # every gpt setting at once, not one refusal after another
    (["model.injection=concat"], None, ["set "]),
    (["parallel.zero_stage=2"], 2, ["use ", "use "]),  # deepspeed for ZeRO-2, then AdamW for deepspeed
    (["parallel.pp=8"], 2, ["use "]),
    (["parallel.engine=deepspeed", "optim.name=adamw", "parallel.pp=2"], 2, ["(or "]),
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


def test_seq_len_of_the_shards_is_proposed_and_loads(tiny_shards):
    settings = [f"data.shards={tiny_shards}", "model.vocab_size=512", "model.seq_len=64"]
    with pytest.raises(ConfigError) as refused:
        load_config(str(TINY), settings)
    settings += proposed(str(refused.value), "; set ")
    assert settings[-1] == "model.seq_len=32"
    assert load_config(str(TINY), settings).model.seq_len == 32
