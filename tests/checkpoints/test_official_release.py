"""Official release folders (config.json + model.pt as the official save_pretrained writes them) <-> megaloop.

The folders are built here from the official layout as facts (the config dataclass dump, the state_dict key names,
the value-embedding rule), without the official code. Checks: the config megaloop derives is the one written here by
hand; a converted model's logits equal those of megaloop's model built directly from the same weights; official ->
megaloop -> official is bit-exact in the weights and identical in config.json; settings megaloop cannot compute and
bad input are refused in one line with exit code 2, leaving nothing behind.
"""
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from checkpoints.cli import main
from checkpoints.official_release import megaloop_model_section, official_config_for, resolve_official_config
from megaloop.config import ModelConfig, load_config
from megaloop.config.load import from_dict
from megaloop.eval.checkpoint import load_model
from megaloop.model import build_model

REPO = Path(__file__).resolve().parents[2]


# ---- official configs, as dataclasses.asdict writes them (field order included) ---------------------------------
def base_fields(**over) -> dict:
    """The official Config's fields, in declaration order, for a tiny model."""
    out = {
        "name": "tiny", "hf_config": {"org": "test", "name": "tiny"}, "block_size": 32, "n_embd": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 200,
        "padding_multiple": 64, "padded_vocab_size": 256,
        "rope_settings": {"use_rope": True, "rope_condense_ratio": 1, "rope_base": 10000},
        "use_abacus": False, "randomize_positions_from": None, "block_class_name": "TransformerPreNormBlock",
        "norm_class_name": "RMSNorm", "attn_impl": "flash", "norm_eps": 1e-05, "mlp_class_name": "BaseMLP",
        "nonlin_name": "ReLU2", "bias": False, "qk_bias": False, "init_strategy": "scaled-zero",
        "init_orthogonal": True, "skip_initialization": False, "mup_model_scaling_factor": 1,
        "use_fused_head": "pytorch", "debias_attention": False, "center_attention": False, "clip_qkv": None,
        "qk_norm": True, "logit_softcap": None, "activation_checkpoint_impl": "per-iteration", "simple_ops": False,
        "strategy": "single",
    }
    return {**out, **over}


def parcae_json(**over) -> dict:
    out = {**base_fields(), "injection_type": "diagonal", "n_layers_in_recurrent_block": 2,
           "n_layers_in_prelude": 1, "n_layers_in_coda": 1, "state_init": "like-init",
           "recurrent_embedding_dimension": 64, "recurrent_intermediation_embedding_dimension": 128,
           "recurrent_num_attention_heads": None, "prelude_norm": True, "sampling_scheme": "poisson-truncated-full",
           "mean_recurrence": 4, "mean_backprop_depth": 2, "lockstep_n": False, "lockstep_k": False,
           "curriculum_target": "forward", "recurrent_iteration_method": "per-sequence", "tie_embeddings": True,
           "model_class_name": "Parcae", "_is_recurrent_block_config": False, "_class_name": "ParcaeConfig"}
    return {**out, **over}


def gpt_json(**over) -> dict:
    out = {**base_fields(num_key_value_heads=2, intermediate_size=96, norm_eps=1e-06,
                         rope_settings={"use_rope": True, "rope_condense_ratio": 1, "rope_base": 50000},
                         activation_checkpoint_impl="per-block"),
           "n_layer": 3, "tie_embeddings": True, "_class_name": "GPTConfig"}
    return {**out, **over}


def rdm_json() -> dict:
    return parcae_json(num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                       recurrent_intermediation_embedding_dimension=64, mlp_class_name="GatedMLP", nonlin_name="SiLU",
                       injection_type="linear", n_layers_in_recurrent_block=1, prelude_norm=False,
                       mean_recurrence=3, mean_backprop_depth=1, sampling_scheme="fixed",
                       recurrent_iteration_method="per-batch")


# (official config.json, the ModelConfig megaloop must compute it with, the effective layers with value embeddings
# worked out by hand from the official rule: gate by layer id against n_recurrent * mean_backprop_depth, table by
# effective index against the effective layer count; both must agree)
CASES = {
    "parcae": (parcae_json(), ModelConfig(
        arch="parcae", vocab_size=256, d_model=64, n_heads=4, n_kv_heads=4, n_prelude=1, n_core=2, n_coda=1,
        mlp="relu2", mlp_hidden=128, block="prenorm", injection="diagonal", prelude_norm=True, use_C=True,
        value_embeds=True, ve_gate_channels=32, seq_len=32, rope_base=10000.0, norm_eps=1e-5, init_std=None,
        mu_rec=4, mu_bwd=2, depth_sampler="poisson-truncated-full"), {1, 3}),
    "gpt": (gpt_json(), ModelConfig(
        arch="gpt", vocab_size=256, d_model=64, n_heads=4, n_kv_heads=2, n_prelude=0, n_core=3, n_coda=0,
        mlp="relu2", mlp_hidden=96, block="prenorm", injection="none", prelude_norm=False, use_C=False,
        value_embeds=True, ve_gate_channels=32, seq_len=32, rope_base=50000.0, norm_eps=1e-6, init_std=None,
        mu_rec=1, mu_bwd=1, depth_sampler="fixed"), {0, 2}),
    "rdm": (rdm_json(), ModelConfig(
        arch="rdm", vocab_size=256, d_model=64, n_heads=2, n_kv_heads=2, n_prelude=1, n_core=1, n_coda=1,
        mlp="swiglu", mlp_hidden=64, block="prenorm", injection="concat", prelude_norm=False, use_C=True,
        value_embeds=True, ve_gate_channels=32, seq_len=32, rope_base=10000.0, norm_eps=1e-5, init_std=None,
        mu_rec=3, mu_bwd=1, depth_sampler="fixed"), {0, 2}),
}


# ---- official weights ---------------------------------------------------------------------------------------------
_PARTS = {"attn.q.": "attn.c_q.", "attn.k.": "attn.c_k.", "attn.v.": "attn.c_v.", "attn.proj.": "attn.c_proj."}
_FIXED = {"embed.weight": "transformer.wte.weight", "final_norm.weight": "transformer.ln_f.weight",
          "prelude_norm.weight": "transformer.ln_prelude.weight", "C.weight": "transformer.C.weight",
          "injection.A_log": "transformer.adapter.A_log", "injection.dt_bias": "transformer.adapter.dt_bias",
          "injection.B": "transformer.adapter.B", "injection.W.weight": "transformer.adapter.adapter.weight"}


def official_key(name: str, gpt: bool) -> str:
    """The official key of one of megaloop's parameters (the official module tree, written out)."""
    if name in _FIXED or name.startswith("value_embeds."):
        return _FIXED.get(name, name)
    stack, index, part = name.split(".", 2)
    for ours, theirs in _PARTS.items():
        part = part.replace(ours, theirs) if part.startswith(ours) else part
    return f"transformer.h.{index}.{part}" if gpt else \
        f"transformer.{ {'core': 'core_block'}.get(stack, stack)}.{index}.{part}"


def rope(cfg: dict) -> torch.Tensor:
    """freqs_cis [1, T, 1, head_dim/2, 2]: (cos, sin) of t * base^(-2j/head_dim), here in fp64, stored in fp32."""
    hd = cfg["n_embd"] // cfg["num_attention_heads"]
    base = float(cfg["rope_settings"]["rope_base"])
    angle = torch.arange(cfg["block_size"], dtype=torch.float64)[:, None] * base ** (
        -torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    return torch.stack([angle.cos(), angle.sin()], -1)[None, :, None].float()


@pytest.fixture(scope="module", params=sorted(CASES))
def release(request, tmp_path_factory):
    """(kind, config.json dict, expected ModelConfig, megaloop model, its official state_dict, folder)."""
    return make_release(request.param, tmp_path_factory.mktemp(request.param) / "release")


def make_release(kind: str, folder: Path):
    """A release folder of CASES[kind] whose weights are those of a megaloop model with random weights."""
    cfg_json, model_cfg, with_ve = CASES[kind]
    model = build_model(model_cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # the init zeroes some projections: make every weight count
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    model.eval()
    gpt = kind == "gpt"
    state = {"freqs_cis": rope(cfg_json)}
    state.update({official_key(n, gpt): p.detach().clone() for n, p in model.named_parameters()})
    state["lm_head.weight"] = state["transformer.wte.weight"]  # tied: one tensor under two names
    gates = {k for k in state if k.endswith("ve_gate.weight")}
    blocks = [f"transformer.h.{i}" for i in range(3)] if gpt else (
        ["transformer.prelude.0"] + [f"transformer.core_block.{i}" for i in range(model_cfg.n_core)]
        + ["transformer.coda.0"])
    assert gates == {f"{blocks[k]}.attn.ve_gate.weight" for k in with_ve}
    assert {k for k in state if k.startswith("value_embeds.")} == {f"value_embeds.{k}.weight" for k in with_ve}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg_json, indent=2))
    torch.save(state, folder / "model.pt")
    return kind, cfg_json, model_cfg, model, state, folder


def logits(model, ids, depth):
    with torch.no_grad():
        return model(ids, depth=depth).logits


def one_line_error(capsys, argv, needle) -> str:
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("checkpoints: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert "; " in err and needle in err, err
    return err


# ---- round trips --------------------------------------------------------------------------------------------------
def test_release_converts_to_the_model_megaloop_builds_from_it(release, tmp_path, capsys):
    kind, cfg_json, model_cfg, model, _, folder = release
    assert main(["convert", "--from-official", str(folder), "--out", str(tmp_path / "ckpt")]) == 0
    assert "checkpoint.resume=" in capsys.readouterr().out
    loaded = load_model(tmp_path / "ckpt")
    assert loaded.model.cfg == model_cfg  # every field, as written by hand above
    assert list(loaded.config) == ["model"]  # a model section only: train with a config of your own
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    depths = [1] if kind == "gpt" else [1, model_cfg.mu_rec, 2 * model_cfg.mu_rec]
    for depth in depths:  # the same fp32 computation on the same weights: equal to the bit
        assert torch.equal(logits(loaded.model, ids, depth), logits(model, ids, depth)), depth


def test_release_round_trip_is_bit_exact(release, tmp_path, capsys):
    kind, cfg_json, _, _, state, folder = release
    assert main(["convert", "--from-official", str(folder), "--out", str(tmp_path / "ckpt")]) == 0
    out = tmp_path / "again"
    assert main(["convert", "--to-official", str(tmp_path / "ckpt"), "--out", f"{out}/"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "ckpt"]  # no temporary folder left
    text = (out / "config.json").read_text()
    back = json.loads(text)
    assert back == cfg_json and list(back) == list(cfg_json) and text == json.dumps(cfg_json, indent=2)
    weights = torch.load(out / "model.pt", weights_only=True)
    order = list(weights)  # the official model's order: its own buffer, then the modules' tensors, the head last
    assert set(order) == set(state) and order[:2] == ["freqs_cis", "transformer.wte.weight"]
    tables = [i for i, k in enumerate(order) if k.startswith("value_embeds.")]
    assert order[-1] == "lm_head.weight" and order.index("transformer.ln_f.weight") < min(tables)
    for key, tensor in state.items():
        if key == "freqs_cis":  # regenerated in fp32 (here from fp64): within a few fp32 ulps
            assert weights[key].dtype == torch.float32
            torch.testing.assert_close(weights[key], tensor, rtol=0, atol=1e-5)
            continue
        assert weights[key].dtype == tensor.dtype and torch.equal(weights[key].view(torch.uint8),
                                                                  tensor.view(torch.uint8)), key
    assert weights["lm_head.weight"].data_ptr() == weights["transformer.wte.weight"].data_ptr()  # tied, as saved
    capsys.readouterr()


@pytest.mark.parametrize("weights_file", ["pytorch_model.bin", "model.safetensors"])
def test_release_weights_under_other_names_and_wrappers(weights_file, tmp_path):
    """pytorch_model.bin (what the official loader tries first) and safetensors (which stores no aliasing), with
    the _orig_mod. prefix a compiled model's state_dict carries."""
    cfg_json, model_cfg, _ = CASES["parcae"]
    model = build_model(model_cfg, seed=3)
    state = {"_orig_mod." + official_key(n, False): p.detach().clone() for n, p in model.named_parameters()}
    state["_orig_mod.lm_head.weight"] = state["_orig_mod.transformer.wte.weight"].clone()
    folder = tmp_path / "release"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg_json))
    if weights_file.endswith(".safetensors"):
        save_file(state, str(folder / weights_file))
    else:
        torch.save(state, folder / weights_file)
    assert main(["convert", "--from-official", str(folder), "--out", str(tmp_path / "ckpt")]) == 0
    loaded = load_model(tmp_path / "ckpt").model
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in loaded.named_parameters())


def test_the_140m_releases_derive_megaloops_own_configs():
    """The published 140m configs (their values from the official configs) give the model sections of
    configs/parcae-140m.yaml and configs/gpt-140m.yaml, in every value megaloop computes with; and a megaloop
    model of those configs exports to the published config, all but its name."""
    size = dict(name="parcae-small-140m", hf_config={"org": "SandyResearch", "name": "parcae-small-140m"},
                block_size=2048, n_embd=768, intermediate_size=3072, num_attention_heads=6, num_key_value_heads=6,
                vocab_size=32768, padded_vocab_size=32768,
                rope_settings={"use_rope": True, "rope_condense_ratio": 1, "rope_base": 50000})
    parcae = parcae_json(**size, n_layers_in_prelude=2, n_layers_in_coda=2, recurrent_embedding_dimension=768,
                         recurrent_intermediation_embedding_dimension=3072, mean_recurrence=8, mean_backprop_depth=4)
    gpt = gpt_json(**base_fields(**size, activation_checkpoint_impl="per-block"), n_layer=6)
    properties = ("arch", "vocab_size", "d_model", "n_heads", "kv_heads", "n_prelude", "n_core", "n_coda", "mlp",
                  "ffn_hidden", "block", "injection", "prelude_norm", "use_C", "value_embeds", "ve_gate_channels",
                  "seq_len", "rope_base", "norm_eps", "std", "mu_rec", "backprop_depth", "depth_sampler")
    for official, yaml_name in ((parcae, "parcae-140m.yaml"), (gpt, "gpt-140m.yaml")):
        ours = load_config(REPO / "configs" / yaml_name).model
        derived = from_dict(ModelConfig, megaloop_model_section(resolve_official_config(official)), "model.")
        derived.validate()
        assert {p: getattr(derived, p) for p in properties} == {p: getattr(ours, p) for p in properties}
        assert derived.std == math.sqrt(2 / (5 * 768))
        exported = official_config_for(json.loads(json.dumps(load_config(REPO / "configs" / yaml_name)
                                                             .to_dict()["model"])))
        assert exported == {**official, "name": "", "hf_config": {}}


def test_gpt_blocks_in_prelude_and_coda_export_as_one_stack(tmp_path, capsys):
    """A megaloop GPT may hold its blocks as prelude + core + coda: the official GPT numbers them j = 0, 1, 2."""
    cfg = ModelConfig(arch="gpt", vocab_size=256, d_model=64, n_heads=4, n_prelude=1, n_core=1, n_coda=1,
                      injection="none", prelude_norm=False, use_C=False, seq_len=32, mu_rec=1, depth_sampler="fixed")
    model = build_model(cfg, seed=0)
    ckpt = _save_megaloop(model, cfg, tmp_path / "ckpt")
    (tmp_path / "gpt").mkdir()  # an existing empty directory receives the folder
    assert main(["convert", "--to-official", str(ckpt), "--out", str(tmp_path / "gpt")]) == 0
    weights = torch.load(tmp_path / "gpt" / "model.pt", weights_only=True)
    for j, block in enumerate((model.prelude[0], model.core[0], model.coda[0])):
        assert torch.equal(weights[f"transformer.h.{j}.attn.c_q.weight"], block.attn.q.weight)
    assert json.loads((tmp_path / "gpt" / "config.json").read_text())["n_layer"] == 3
    capsys.readouterr()


def test_gpt_weights_file_with_a_config_converts_both_ways(tmp_path, capsys):
    """The FILE + --config form knows the official GPT's keys too (transformer.h.{j}), and writes them back."""
    _, _, model_cfg, model, state, _ = make_release("gpt", tmp_path / "release")
    (tmp_path / "config.json").write_text(json.dumps({"model": model_cfg.__dict__}))
    assert main(["convert", "--from-official", str(tmp_path / "release" / "model.pt"), "--config",
                 str(tmp_path / "config.json"), "--out", str(tmp_path / "ckpt")]) == 0
    loaded = load_model(tmp_path / "ckpt").model
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in loaded.named_parameters())
    assert main(["convert", "--to-official", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back.pt")]) == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert set(back) == set(state) - {"freqs_cis"} and all(torch.equal(back[k], state[k]) for k in back)
    capsys.readouterr()


def _save_megaloop(model, cfg, root: Path) -> Path:
    from checkpoints import Checkpointer, Piece
    from megaloop.config import Config

    pieces = [Piece(f"model/{n}", tuple(p.shape), (0,) * p.dim(), p.detach()) for n, p in model.named_parameters()]
    with Checkpointer(root, async_save=False) as saver:
        saver.save(1, pieces, {"config": {**Config().to_dict(), "model": json.loads(json.dumps(cfg.__dict__))}})
        assert saver.wait().ok
    return root


# ---- refusals -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("over,needle", [
    ({"qk_norm": False}, "qk_norm=false"),
    ({"tie_embeddings": False}, "tie_embeddings=false"),
    ({"logit_softcap": 15.0}, "logit_softcap=15.0"),
    ({"bias": True}, "bias=true"),
    ({"recurrent_embedding_dimension": 128}, "recurrent_embedding_dimension=128"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ({"init_strategy": "takase"}, 'init_strategy="takase"'),
    ({"state_init": "zero"}, 'state_init="zero"'),
    ({"norm_class_name": "LayerNorm"}, 'norm_class_name="LayerNorm"'),
    ({"rope_settings": {"use_rope": True, "rope_condense_ratio": 2, "rope_base": 10000}},
     "rope_settings.rope_condense_ratio=2"),
    ({"sampling_scheme": "poisson-unbounded"}, 'sampling_scheme="poisson-unbounded"'),
    ({"mean_backprop_depth": 5}, "mean_backprop_depth=5"),
    ({"n_layers_in_recurrent_block": 1}, "n_layers_in_recurrent_block * mean_backprop_depth=1 * 2"),
    # only the coda's gate differs: its layer id is n_prelude + n_recurrent * mean_recurrence = 5, gated against 1
    ({"n_layers_in_recurrent_block": 1, "mean_backprop_depth": 1}, "effective layers [2] a value-embedding gate"),
    ({"_class_name": "LlamaConfig"}, '_class_name=\'LlamaConfig\''),
    ({"n_layer": 4}, "['n_layer'] are not fields of the official ParcaeConfig"),
])
def test_settings_megaloop_cannot_compute_are_refused_by_name(tmp_path, capsys, over, needle):
    folder = tmp_path / "release"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(parcae_json(**over)))
    torch.save({}, folder / "model.pt")
    one_line_error(capsys, ["convert", "--from-official", folder, "--out", tmp_path / "ckpt"], needle)
    assert not (tmp_path / "ckpt").exists()


def test_bad_release_input_is_one_line_with_exit_code_2(tmp_path, capsys):
    _, cfg_json, _, _, state, folder = make_release("parcae", tmp_path / "release")

    def folder_with(config=cfg_json, weights=state, name="bad"):
        path = tmp_path / name
        path.mkdir()
        if config is not None:
            (path / "config.json").write_text(json.dumps(config))
        torch.save(weights, path / "model.pt")
        return path

    out = tmp_path / "out"
    one_line_error(capsys, ["convert", "--from-official", folder_with(config=None, name="noconfig"), "--out", out],
                   "no config.json")
    one_line_error(capsys, ["convert", "--from-official", folder_with({**cfg_json, "_class_name": "MambaConfig"},
                                                                     name="class"), "--out", out], "MambaConfig")
    short = {k: v for k, v in state.items() if k != "transformer.coda.0.mlp.proj.weight"}
    one_line_error(capsys, ["convert", "--from-official", folder_with(weights=short, name="short"), "--out", out],
                   "missing keys 'transformer.coda.0.mlp.proj.weight'")
    extra = {**state, "transformer.coda.0.attn.qk_bias": torch.zeros(2, 1, 4, 16)}
    one_line_error(capsys, ["convert", "--from-official", folder_with(weights=extra, name="extra"), "--out", out],
                   "unexpected keys 'transformer.coda.0.attn.qk_bias'")
    shifted = {**state, "freqs_cis": rope({**cfg_json, "rope_settings": {"rope_base": 50000}})}
    one_line_error(capsys, ["convert", "--from-official", folder_with(weights=shifted, name="rope"), "--out", out],
                   "freqs_cis differs from the RoPE table of rope_settings.rope_base=10000")
    one_line_error(capsys, ["convert", "--from-official", folder, "--config", folder / "config.json", "--out", out],
                   "drop --config")
    assert not out.exists()

    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    one_line_error(capsys, ["convert", "--from-official", folder, "--out", used], "not an empty directory")
    assert main(["convert", "--from-official", str(folder), "--out", str(tmp_path / "ckpt")]) == 0
    one_line_error(capsys, ["convert", "--to-official", tmp_path / "ckpt", "--out", used], "exists and is not empty")
    one_line_error(capsys, ["convert", "--to-official", tmp_path / "ckpt", "--out", f"{used / 'notes.txt'}/"],
                   "not a directory")
    assert sorted(p.name for p in used.iterdir()) == ["notes.txt"] and (used / "notes.txt").read_text() == "mine"


def test_to_official_refuses_models_the_official_code_cannot_build(tmp_path, capsys):
    cfg = ModelConfig(arch="parcae", vocab_size=256, d_model=64, n_heads=4, n_prelude=1, n_core=2, n_coda=1,
                      block="sandwich", seq_len=32, mu_rec=4, mu_bwd=2)
    ckpt = _save_megaloop(build_model(cfg, seed=0), cfg, tmp_path / "ckpt")
    one_line_error(capsys, ["convert", "--to-official", ckpt, "--out", tmp_path / "release"],
                   'model.block="sandwich"')
    cfg = ModelConfig(arch="parcae", vocab_size=256, d_model=64, n_heads=4, n_prelude=1, n_core=1, n_coda=1,
                      seq_len=32, mu_rec=4, mu_bwd=2)  # the official gates would not match its value tables
    ckpt = _save_megaloop(build_model(cfg, seed=0), cfg, tmp_path / "ckpt2")
    one_line_error(capsys, ["convert", "--to-official", ckpt, "--out", tmp_path / "release"], "value-embedding gate")
    assert not (tmp_path / "release").exists()
