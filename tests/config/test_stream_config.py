"""The streaming keys of the data section: a corpus or a list of them (s3://, http(s)://, directories), the mix
weights, the order and its default, and one-line errors for bad values."""
from __future__ import annotations

from pathlib import Path

import pytest

from megaloop.config import ConfigError, load_config
from megaloop.train.data import data_order

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "parcae-tiny.yaml")


def test_remote_shards_a_list_with_a_mix_and_the_default_order():
    one = load_config(TINY, ["data.shards=s3://bucket/corpus"])
    assert one.data.shards == "s3://bucket/corpus" and data_order(one) == "blocks"
    mixed = load_config(TINY, ["data.shards=[s3://bucket/a, https://host/b]", "data.mix=[0.7, 0.3]"])
    assert mixed.data.shards == ["s3://bucket/a", "https://host/b"] and mixed.data.mix == [0.7, 0.3]
    assert data_order(load_config(TINY, ["data.shards=s3://b/c", "data.order=global"])) == "global"


@pytest.mark.parametrize("override, key", [
    (["data.shards=[s3://b/a, s3://b/c]", "data.mix=[1.0]"], "data.mix"),
    (["data.shards=s3://b/a", "data.order=random"], "data.order"),
    (["data.shards=s3://b/a", "data.cache_gib=0"], "data.cache_gib"),
    (["data.shards=[]"], "data.shards"),
])
def test_bad_streaming_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, override)
    assert str(err.value).startswith(key) or key in str(err.value).splitlines()[0]
