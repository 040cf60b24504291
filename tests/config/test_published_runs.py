"""The shipped configs are the published runs (PARCAE_REFERENCE.md section 11), held to a table written once here,
so that a config cannot drift from the paper silently; and the token budget (train.tokens) resolves to the steps the
trainer runs, with its bad inputs refused."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from megaloop.config import ConfigError, load_config
from megaloop.config.budget import parse_tokens

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"

# run -> (tokens, AdamW lr, Muon lr, checkpoint every, evaluate every, activation checkpointing on)
PUBLISHED = {
    "parcae-140m": (11.2e9, 8e-3, 8e-3, 1024, 512, False),
    "parcae-370m": (29.6e9, 8e-3, 8e-3, 2048, 1024, False),
    "parcae-770m": (61.6e9, 6e-3, 8e-3, 4096, 4096, False),
    "parcae-1_3b": (104e9, 6e-3, 8e-3, 4096, 4096, True),
    "gpt-140m": (11.2e9, 8e-3, 8e-3, 1024, 512, False),
    "gpt-370m": (29.6e9, 8e-3, 8e-3, 2048, 1024, False),
    "gpt-770m": (61.6e9, 6e-3, 8e-3, 4096, 4096, False),
    "gpt-1_3b": (104e9, 6e-3, 8e-3, 4096, 4096, True),
}
# configs that are not published runs, and why they are exempt from the table
NOT_PUBLISHED = {
    "parcae-tiny": "the CPU quickstart's model",
    "parcae-synth": "the CPU synthetic testbed (docs/reproduction.md)", "gpt-synth": "its GPT twin",
    "rdm-synth": "its RDM twin",
    "rdm-140m": "an RDM baseline of the stability study, not a published run", "rdm-370m": "the same",
    "rdm-770m": "the same", "rdm-1_3b": "the same",
}


def test_every_shipped_config_is_in_the_table_or_exempt():
    shipped = {p.stem for p in CONFIGS.glob("*.yaml")}
    assert shipped == set(PUBLISHED) | set(NOT_PUBLISHED), "a new config: add it to PUBLISHED or NOT_PUBLISHED"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_config_is_the_published_run(name):
    tokens, adam_lr, muon_lr, ckpt_every, val_every, checkpointing = PUBLISHED[name]
    cfg = load_config(CONFIGS / f"{name}.yaml")
    t, o, d, m = cfg.train, cfg.optim, cfg.data, cfg.model
    assert t.tokens == tokens  # the budget itself, not only the steps it rounds to
    assert t.steps == math.ceil(tokens / (256 * 2048))
    assert (d.global_batch_size, m.seq_len, m.vocab_size) == (256, 2048, 32768)
    assert (o.name, o.adam_lr, o.matrix_lr) == ("muon", adam_lr, muon_lr)
    assert (o.warmup_steps, o.cooldown_fraction, o.final_lr_fraction, o.grad_clip) == (0, 0.5, 0.0, 1.0)
    assert (tuple(o.betas), o.eps, o.adam_weight_decay) == ((0.8, 0.95), 1e-10, 0.0)
    assert (o.muon_momentum[1], o.muon_weight_decay, o.ns_steps, o.nesterov) == (0.95, 0.2, 5, True)
    assert (t.seed, cfg.checkpoint.every, t.val_every, d.val_batches) == (42, ckpt_every, val_every, 16)
    assert (t.activation_checkpointing != "none") == checkpointing
    assert d.packing == "bestfit"
    if name.startswith("parcae"):
        assert (m.mu_rec, m.backprop_depth, m.depth_sampler) == (8, 4, "poisson-truncated-full")
        assert t.val_depths == [1, 2, 4, m.mu_rec]
    else:
        assert t.val_depths is None and not m.is_looped  # a GPT evaluates at its one depth


def test_steps_from_tokens_by_hand():
    """104e9 / (256 x 2048) = 198,364.3: the trainer runs 198,365 steps; 11.2e9 / 524,288 = 21,362.3 -> 21,363."""
    assert load_config(CONFIGS / "parcae-1_3b.yaml").train.steps == 198_365
    assert load_config(CONFIGS / "parcae-140m.yaml").train.steps == 21_363
    exact = load_config(CONFIGS / "parcae-tiny.yaml", ["train.tokens=4096"])  # 16 x 128 = 2048 a step
    assert (exact.train.steps, exact.train.tokens) == (2, 4096)


@pytest.mark.parametrize("text, tokens", [("104B", 104_000_000_000), ("11.2B", 11_200_000_000), ("104e9", 104e9),
                                          ("1.04e+11", 104e9), ("500M", 500_000_000), ("2k", 2000), (4096, 4096)])
def test_token_counts_parse(text, tokens):
    assert parse_tokens(text) == tokens


def test_an_override_of_one_length_replaces_the_files_other():
    """The file gives train.tokens; --set train.steps=100 shortens the run instead of being refused."""
    short = load_config(CONFIGS / "parcae-1_3b.yaml", ["train.steps=100"])
    assert (short.train.steps, short.train.tokens) == (100, None)
    budget = load_config(CONFIGS / "parcae-tiny.yaml", ["train.tokens=20480"])  # the file gives train.steps
    assert (budget.train.steps, budget.train.tokens) == (10, 20480)


@pytest.mark.parametrize("overrides, phrase", [
    (["train.tokens=1e9", "train.steps=10"], "given together with train.steps=10 on the command line"),
    (["train.tokens=2047"], "smaller than one step"),
    (["train.tokens=0"], "positive token count"),
    (["train.tokens=lots"], "must be a token count"),
])
def test_bad_token_budgets(overrides, phrase):
    with pytest.raises(ConfigError, match=phrase):
        load_config(CONFIGS / "parcae-tiny.yaml", overrides)


def test_a_file_with_both_lengths_is_refused(tmp_path):
    both = tmp_path / "both.yaml"
    both.write_text((CONFIGS / "parcae-tiny.yaml").read_text().replace("train:\n", "train:\n  tokens: 1e9\n", 1))
    with pytest.raises(ConfigError, match=f"given together with train.steps=300 in {both}"):
        load_config(both)


def test_cli_refuses_both_lengths_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megaloop", "train", str(CONFIGS / "parcae-tiny.yaml"), "--set",
                           "train.tokens=1e9", "--set", "train.steps=10", "--set", f"train.out_dir={out}"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and not out.exists()
    assert len(proc.stderr.strip().splitlines()) == 1 and "give exactly one" in proc.stderr


def test_check_prints_the_budget_and_rates():
    proc = subprocess.run([sys.executable, "-m", "megaloop", "check", str(CONFIGS / "parcae-1_3b.yaml")],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    tail = proc.stdout.splitlines()[-2:]
    assert tail[0] == ("run: 104B tokens (train.tokens) = 198,365 steps x 256 x 2048 tokens (104,000,389,120 "
                       "tokens trained)")
    assert tail[1] == "optimizer: muon: Muon (matrices) lr 0.008, AdamW (the rest) lr 0.006"
    tree = json.loads("\n".join(proc.stdout.splitlines()[:-3]))
    assert tree["train"]["tokens"] == 104_000_000_000 and tree["train"]["steps"] == 198_365


@pytest.mark.parametrize("record, wanted, refused", [
    (None, "bestfit", True),  # a manifest from before packing was recorded: stream
    ({"mode": "stream"}, "bestfit", True),
    ({"mode": "bestfit"}, "bestfit", False),
    ({"mode": "bestfit"}, "stream", True),
    (None, None, False),  # data.packing null: any shards
])
def test_data_packing_is_held_to_the_manifest(tmp_path, record, wanted, refused):
    manifest = {"seq_len": 128, "row_len": 129, "tokenizer": {"vocab_size": 4096, "bos_id": 0}}
    if record is not None:
        manifest["packing"] = record
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    sets = [f"data.shards={tmp_path}"] + ([f"data.packing={wanted}"] if wanted else [])
    if not refused:
        assert load_config(CONFIGS / "parcae-tiny.yaml", sets).data.packing == wanted
        return
    have = record["mode"] if record else "stream"
    with pytest.raises(ConfigError, match=f"were packed with {have}; re-create them with `python -m data_prep "
                                          f"shards --packing {wanted}`, or set data.packing=null"):
        load_config(CONFIGS / "parcae-tiny.yaml", sets)


def test_a_streamed_corpus_manifest_is_held_to_packing_and_bos_when_read():
    """s3:// and http(s):// manifests are read when training starts (megaloop/train/data.py): the same refusals."""
    from megaloop.train.data import _check_remote_manifest

    manifest = {"seq_len": 128, "tokenizer": {"vocab_size": 4096, "bos_id": 0}, "packing": {"mode": "stream"}}
    cfg = load_config(CONFIGS / "parcae-tiny.yaml", ["data.packing=bestfit"])
    with pytest.raises(ConfigError, match="the shards at s3://b/p were packed with stream"):
        _check_remote_manifest(cfg, manifest, "s3://b/p")
    masked = load_config(CONFIGS / "parcae-tiny.yaml", ["model.doc_mask=true", "model.bos_id=3",
                                                        "model.doc_attention_share=0.5"])
    with pytest.raises(ConfigError, match="mark documents with BOS id 0; set model.bos_id=0"):
        _check_remote_manifest(masked, manifest, "s3://b/p")
    unframed = {**manifest, "packing": {"mode": "stream", "bos_framed": False}}
    with pytest.raises(ConfigError, match="have no BOS-framed documents"):
        _check_remote_manifest(load_config(CONFIGS / "parcae-tiny.yaml", ["model.doc_mask=true", "model.bos_id=0",
                                                                          "model.doc_attention_share=0.5"]),
                               unframed, "s3://b/p")
    _check_remote_manifest(load_config(CONFIGS / "parcae-tiny.yaml", ["model.doc_mask=true", "model.bos_id=0",
                                                                      "model.doc_attention_share=0.5"]),
                           manifest, "s3://b/p")  # agrees: no error
