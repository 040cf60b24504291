"""Config checks before any work: train.fp8 where no block layer can run in FP8 is a config error, the config's idea of
the block layers' shapes is the model's own, and a missing config file names the checkout's configs folder."""
from pathlib import Path

import pytest
import torch

from megaloop.__main__ import main
from megaloop.config import ConfigError, load_config
from megaloop.config.fp8_layers import block_linear_shapes, fp8_eligible
from megaloop.model import build_model
from pipeline.fp8 import convert_to_float8

TINY = Path(__file__).resolve().parents[2] / "configs" / "parcae-tiny.yaml"
NARROW = ["model.d_model=120", "model.n_heads=4", "train.fp8=tensorwise"]


def test_fp8_with_no_qualifying_layer_is_refused_naming_the_widths():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, NARROW, world_size=1)
    message = str(err.value)
    assert "train.fp8" in message and "mlp.fc 120->480" in message and "multiples of 16" in message


def test_megaloop_check_exits_2_with_one_line(capsys):
    assert main(["check", str(TINY), *(a for o in NARROW for a in ("--set", o))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no linear layer of the blocks can run in FP8" in err


@pytest.mark.parametrize("overrides", [[], ["model.d_model=120", "model.n_heads=4"],
                                       ["model.mlp=swiglu", "model.mlp_hidden=200"], ["model.n_kv_heads=2"]])
def test_shapes_and_eligibility_match_the_built_model(overrides):
    """The shapes the check reads off the config are the built blocks' weights, and the layers it calls eligible
    are exactly those the FP8 conversion converts (an independent count, on the model itself)."""
    cfg = load_config(TINY, overrides, world_size=1).model
    model = build_model(cfg)
    shapes = block_linear_shapes(cfg)
    for name, module in model.core.named_modules():
        if isinstance(module, torch.nn.Linear):
            role = name.split(".", 1)[1]
            assert shapes[role] == (module.in_features, module.out_features), name
    converted = convert_to_float8(model, "tensorwise", ("core.*",)).converted
    expected = sorted(f"core.{i}.{role}" for i, block in enumerate(model.core) for role in fp8_eligible(cfg)
                      if role != "attn.ve_gate" or block.attn.ve_gate is not None)
    assert sorted(converted) == expected


def test_a_missing_config_names_the_checkouts_configs_from_any_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # run from outside the checkout: "configs/*.yaml" alone would point nowhere
    assert main(["check", "configs/parcae-tny.yaml"]) == 2
    err = capsys.readouterr().err
    assert str(TINY.parent) in err and (TINY.parent / "parcae-tiny.yaml").is_file()
