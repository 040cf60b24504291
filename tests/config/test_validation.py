"""Invalid configs fail before any model is built, naming the field and the allowed values;
unknown keys get a suggestion; types are checked; batch sizes must be consistent."""
import json
from pathlib import Path

import pytest

import megaloop.model.looped as looped
from megaloop.config import ConfigError, load_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "parcae-tiny.yaml"


@pytest.fixture(autouse=True)
def no_model_may_be_built(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was built although the config is invalid")
    monkeypatch.setattr(looped.LoopedLM, "__init__", refuse)


@pytest.mark.parametrize("override,field,allowed", [
    ("model.n_heads=3", "model.n_heads", "must divide model.d_model=128"),
    ("model.mu_bwd=9", "model.mu_bwd", "must be in [1, model.mu_rec=4]"),
    ("model.mu_rec=0", "model.mu_rec", ">= 1"),
    ("model.injection=diagnal", "model.injection", "allowed values: diagonal, additive, concat, none"),
    ("model.depth_sampler=poisson", "model.depth_sampler", "poisson-truncated-full"),
    ("model.n_kv_heads=3", "model.n_kv_heads", "allowed [1, 2, 4]"),
    ("train.precision=fp16", "train.precision", "bf16, fp32, fp64"),
    ("optim.name=sgd", "name", "muon"),
    ("parallel.pp=3", "parallel.pp", "use parallel.pp <= 2"),
    ("checkpoint.every=-1", "checkpoint.every", "must be >= 0"),
    ("checkpoint.keep=0", "checkpoint.keep", "must be >= 1"),
    ("train.stop_at_step=0", "train.stop_at_step", ">= 1 or null"),
    ("train.extend=restart", "train.extend", "continue, rewarm"),
    ("parallel.pp_message_dtype=fp16", "parallel.pp_message_dtype", "fp32, bf16"),
    ("parallel.p2p_semantics=nccl", "parallel.p2p_semantics", "auto, rendezvous"),
])
def test_invalid_values_name_field_and_allowed(override, field, allowed):
    with pytest.raises(ValueError) as info:
        load_config(TINY, [override])
    message = str(info.value)
    assert field in message and allowed in message, message


@pytest.mark.parametrize("overrides,needles", [
    (["parallel.zero_stage=2"], ["parallel.zero_stage", "native engine runs ZeRO stage 0 or 1"]),
    (["parallel.engine=deepspeed"], ["optim.name=muon", "whole matrix"]),
    (["parallel.engine=deepspeed", "optim.name=adamw", "parallel.tp=2"], ["parallel.tp=2", "tensor parallelism"]),
    (["parallel.engine=deepspeed", "optim.name=adamw", "parallel.zero_stage=0"], ["stages 1, 2, 3"]),
    (["parallel.engine=deepspeed", "optim.name=adamw", "checkpoint.every=10"], ["checkpoint.every", "native engine"]),
    (["parallel.engine=deepspeed", "optim.name=adamw", "train.precision=fp64"], ["train.precision=fp64"]),
    (["parallel.zero_offload=true"], ["parallel.zero_offload", "deepspeed only"]),
])
def test_engine_combinations_checked_up_front(overrides, needles):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    assert all(n in str(info.value) for n in needles), str(info.value)
    load_config(TINY, ["parallel.engine=deepspeed", "optim.name=adamw", "parallel.zero_stage=3"])


def test_world_size_not_a_multiple_of_tp_lists_working_tp():
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["parallel.tp=4"], world_size=6)
    assert "parallel.tp=4" in str(info.value) and "tp values that fit this job and the model's heads: [1, 2]" in \
        str(info.value), str(info.value)
    assert load_config(TINY, ["parallel.tp=2", "data.global_batch_size=48"], world_size=6).dp_size(6) == 3


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["train.setps=10"])
    assert "train.setps" in str(info.value) and "did you mean 'steps'" in str(info.value)
    with pytest.raises(ConfigError, match="did you mean 'model'"):
        load_config(TINY, ["modle.d_model=64"])


@pytest.mark.parametrize("override,needle", [
    ("train.steps=ten", "train.steps='ten': must be an integer"),
    ("model.prelude_norm=3", "must be true or false"),
    ("model.rope_base=abc", "must be a number"),
])
def test_wrong_types(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [override])
    assert needle in str(info.value)


def test_inconsistent_batch_sizes():
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["data.global_batch_size=20", "data.micro_batch_size=8"])
    assert "data.global_batch_size" in str(info.value) and "divisible" in str(info.value)
    with pytest.raises(ConfigError, match="tp x pp x dp = 2 but the job has 4 processes"):
        load_config(TINY, ["parallel.tp=2", "parallel.dp=1"], world_size=4)


def test_vocab_too_small_for_the_data(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"seq_len": 128, "vocab_size": 8192}))
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [f"data.shards={tmp_path}"])
    assert "model.vocab_size" in str(info.value) and "8192" in str(info.value)


def test_missing_data_directory_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no manifest.json"):
        load_config(TINY, [f"data.shards={tmp_path / 'nope'}"])


def test_gpt_and_rdm_combinations_checked():
    with pytest.raises(ConfigError, match="set model.injection=none model.mu_rec=1 model.mu_bwd=1"):
        load_config(TINY, ["model.arch=gpt"])
    with pytest.raises(ConfigError, match="arch rdm uses the concatenation injection"):
        load_config(TINY, ["model.arch=rdm"])


def test_valid_config_loads_with_overrides():
    cfg = load_config(TINY, ["train.steps=7", "model.mu_bwd=null", "optim.betas=[0.9, 0.99]"])
    assert cfg.train.steps == 7 and cfg.model.backprop_depth == 2 and cfg.optim.betas == (0.9, 0.99)


def test_pp_message_dtype_defaults_to_the_compute_dtype():
    import torch

    from megaloop.train.runtime import message_dtype

    dtypes = {p: message_dtype(load_config(TINY, [f"train.precision={p}"])) for p in ("bf16", "fp32", "fp64")}
    assert dtypes == {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
    chosen = load_config(TINY, ["train.precision=bf16", "parallel.pp_message_dtype=fp32"])
    assert message_dtype(chosen) == torch.float32
