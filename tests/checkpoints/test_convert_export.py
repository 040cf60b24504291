"""Official Parcae weights <-> checkpoint conversion and the safetensors export: bit-exact round trips through the
API and `python -m checkpoints`, an export that a fresh model loads with safetensors alone and that gives the
same logits, and bad input (missing files, pickled objects, unknown keys) refused in one line with exit code 2."""
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import bits, fast_write
from safetensors.torch import load_file

import checkpoints.official as official
from checkpoints import Checkpointer, CheckpointError, CheckpointReader, Piece
from checkpoints.cli import main
from checkpoints.export import export_safetensors
from checkpoints.official import ConversionError, checkpoint_to_official, official_to_checkpoint
from megaloop.config import ModelConfig, load_config
from megaloop.model import build_model
from megaloop.model import convert as model_convert
from megaloop.model.convert import to_reference_state_dict

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = ["model.vocab_size=512", "model.seq_len=32"]


@pytest.fixture(scope="module")
def tiny():
    """(config, model, its official-layout state_dict) of a small Parcae with non-trivial weights everywhere."""
    cfg = load_config(REPO / "configs/parcae-tiny.yaml", OVERRIDES)
    model = build_model(cfg.model, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # the reference init zeroes some projections; make every bit count
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return cfg, model, to_reference_state_dict(model.state_dict(), cfg.model)


def assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(bits(a[key]), bits(b[key])), key


def as_json(cfg) -> dict:
    """The config tree as JSON gives it back (tuples become lists)."""
    return json.loads(json.dumps(cfg.to_dict()))


def checkpoint_model_arrays(path) -> dict:
    reader = CheckpointReader(path)
    return {n.removeprefix("model/"): reader.read(n) for n in reader.arrays if n.startswith("model/")}


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "checkpoints", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_model_convert_uses_the_shared_name_mapping():
    assert model_convert.reference_to_ours_key is official.official_to_megaloop_name
    assert model_convert.ours_to_reference_key is official.megaloop_to_official_key
    assert model_convert.ConversionError is ConversionError


def test_official_names_follow_the_reference_layout(tiny):
    """Spot checks written from the reference's key list (PARCAE_REFERENCE.md section 9), reaching our tensors
    through the module tree rather than through names, so that a swapped entry of the mapping is caught."""
    _, model, _ = tiny
    ours = {n: p.detach() for n, p in model.named_parameters()}
    back = {official.megaloop_to_official_key(n): t for n, t in ours.items()}
    expected = {
        "transformer.wte.weight": model.embed.weight,
        "transformer.prelude.0.mlp.fc.weight": model.prelude[0].mlp.fc.weight,
        "transformer.prelude.0.norm_2.weight": model.prelude[0].norm_2.weight,
        "transformer.core_block.1.attn.c_q.weight": model.core[1].attn.q.weight,
        "transformer.core_block.1.attn.c_k.weight": model.core[1].attn.k.weight,
        "transformer.core_block.1.attn.c_v.weight": model.core[1].attn.v.weight,
        "transformer.core_block.0.attn.c_proj.weight": model.core[0].attn.proj.weight,
        "transformer.core_block.0.attn.ve_gate.weight": model.core[0].attn.ve_gate.weight,
        "transformer.coda.0.mlp.proj.weight": model.coda[0].mlp.proj.weight,
        "transformer.adapter.A_log": model.injection.A_log,
        "transformer.adapter.dt_bias": model.injection.dt_bias,
        "transformer.adapter.B": model.injection.B,
        "transformer.C.weight": model.C.weight,
        "transformer.ln_prelude.weight": model.prelude_norm.weight,
        "transformer.ln_f.weight": model.final_norm.weight,
        "value_embeds.3.weight": model.value_embeds["3"].weight,
    }
    for key, tensor in expected.items():
        assert torch.equal(back[key], tensor.detach()), key
        assert official.official_to_megaloop_name("_orig_mod.module." + key) in ours, key
    assert official.official_to_megaloop_name("lm_head.weight") is None
    assert official.official_to_megaloop_name("freqs_cis") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_official_checkpoint_official_round_trip_is_bit_exact(tiny, tmp_path, dtype):
    cfg, model, ref = tiny
    ref = {k: v.to(dtype) for k, v in ref.items()}
    ref["lm_head.weight"] = ref["transformer.wte.weight"]
    wrapped = {("_orig_mod." + k if i % 3 == 1 else "module." + k if i % 3 == 2 else k): v
               for i, (k, v) in enumerate(ref.items())}
    wrapped["freqs_cis"] = torch.zeros(32, 16, dtype=torch.complex64)  # a buffer: regenerated, not stored

    path = official_to_checkpoint(wrapped, cfg.to_dict(), tmp_path / "root", step=3)
    assert path == tmp_path / "root" / "step_00000003"
    reader = CheckpointReader(path)
    assert reader.metadata["source"] == "official" and reader.metadata["config"] == as_json(cfg)
    assert reader.step == 3 and all(n.startswith("model/") for n in reader.arrays)
    ours = {n: p.detach().to(dtype) for n, p in model.named_parameters()}
    assert_same(checkpoint_model_arrays(path), ours)

    back = checkpoint_to_official(path)
    assert_same(back, ref)
    assert back["lm_head.weight"] is back["transformer.wte.weight"]


def test_cli_convert_from_a_pt_file_and_back(tiny, tmp_path, capsys):
    cfg, model, ref = tiny
    src = tmp_path / "parcae.pt"
    torch.save({**ref, "lm_head.weight": ref["transformer.wte.weight"]}, src)
    # the config file is what `python -m megaloop check` prints (JSON, then a size line)
    from megaloop.__main__ import main as megaloop_main

    assert megaloop_main(["check", str(REPO / "configs/parcae-tiny.yaml"),
                          *[a for o in OVERRIDES for a in ("--set", o)]]) == 0
    config_json = tmp_path / "config.json"
    config_json.write_text(capsys.readouterr().out)

    done = run_cli("convert", "--from-official", src, "--config", config_json, "--out", tmp_path / "root",
                   "--step", 7)
    assert done.returncode == 0, done.stderr
    assert "checkpoint.resume=" in done.stdout
    path = tmp_path / "root" / "step_00000007"
    assert CheckpointReader(path).metadata["config"] == as_json(cfg)
    assert_same(checkpoint_model_arrays(path), {n: p.detach() for n, p in model.named_parameters()})

    out = tmp_path / "back.pt"
    done = run_cli("convert", "--to-official", tmp_path / "root", "--out", out)  # a root: its latest checkpoint
    assert done.returncode == 0, done.stderr
    back = torch.load(out, weights_only=True, map_location="cpu")
    assert_same(back, {**ref, "lm_head.weight": ref["transformer.wte.weight"]})

    out = tmp_path / "back.safetensors"
    assert main(["convert", "--to-official", str(path), "--out", str(out)]) == 0
    assert_same(load_file(out), {**ref, "lm_head.weight": ref["transformer.wte.weight"]})


@pytest.fixture
def trained_checkpoint(tiny, tmp_path):
    """A checkpoint as training writes it: model/* parameters, optimizer arrays, config and tokens in metadata."""
    cfg, model, _ = tiny
    pieces = [Piece(f"model/{n}", tuple(p.shape), (0,) * p.dim(), p.detach()) for n, p in model.named_parameters()]
    pieces.append(Piece("optim/adam/exp_avg/embed.weight", (512, 128), (0, 0), torch.ones(512, 128)))
    with Checkpointer(tmp_path / "run", async_save=False, file_writer=fast_write) as saver:
        saver.save(5, pieces, {"config": cfg.to_dict(), "tokens": 1234})
        assert saver.wait().ok
    return tmp_path / "run" / "step_00000005"


def test_export_loads_with_safetensors_alone_and_gives_the_same_logits(tiny, trained_checkpoint, tmp_path):
    cfg, model, _ = tiny
    out = tmp_path / "export" / "parcae.safetensors"
    done = run_cli("export", trained_checkpoint.parent, "--out", out)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == ["parcae.json", "parcae.safetensors"]  # no temp files

    weights = load_file(str(out))
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["step"] == 5 and sidecar["tokens"] == 1234 and sidecar["config"] == as_json(cfg)
    assert set(weights) == {n for n, _ in model.named_parameters()}  # no optimizer state
    fresh = build_model(ModelConfig(**sidecar["config"]["model"]), seed=1)
    fresh.load_state_dict(weights, strict=True)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    model.eval(), fresh.eval()
    with torch.no_grad():
        want, got = model(ids, depth=4).logits, fresh(ids, depth=4).logits
    assert torch.equal(got, want)

    half = export_safetensors(trained_checkpoint, tmp_path / "half.safetensors", dtype="bf16")
    cast = load_file(str(half))
    assert all(t.dtype == torch.bfloat16 for t in cast.values())
    assert torch.equal(cast["embed.weight"], model.embed.weight.detach().to(torch.bfloat16))
    assert json.loads((tmp_path / "half.json").read_text())["dtype"] == "bf16"


# ---- refusals ----------------------------------------------------------------------------------------------------
class Sentinel:
    """Unpickling this creates the file at `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def one_line_error(capsys, argv, needle) -> None:
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("checkpoints: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert "; " in err and needle in err, err


def test_a_pickled_object_is_refused_without_running_it(tiny, tmp_path, capsys):
    cfg, _, ref = tiny
    sentinel = tmp_path / "PWNED"
    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps(cfg.to_dict()))
    evil = tmp_path / "evil.pt"  # a real torch.save zip whose state_dict carries one object beside the tensors
    torch.save({**ref, "extra": Sentinel(sentinel)}, evil)
    done = run_cli("convert", "--from-official", evil, "--config", config_json, "--out", tmp_path / "root")
    assert done.returncode == 2
    assert done.stderr.startswith("checkpoints: ") and done.stderr.count("\n") == 1, done.stderr
    assert "weights_only=True" in done.stderr and "io.open" in done.stderr and "Traceback" not in done.stderr
    bare = tmp_path / "bare.pt"  # a bare pickle stream
    bare.write_bytes(pickle.dumps(Sentinel(sentinel)))
    one_line_error(capsys, ["convert", "--from-official", bare, "--config", config_json, "--out", tmp_path / "root"],
                   "refused by torch.load(weights_only=True)")
    assert not sentinel.exists()
    assert not (tmp_path / "root").exists()


def test_bad_cli_input_is_one_line_with_exit_code_2(tiny, tmp_path, capsys, trained_checkpoint):
    cfg, _, ref = tiny
    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps(cfg.to_dict()))
    good = tmp_path / "good.pt"
    torch.save(ref, good)
    bad_key = tmp_path / "bad.pt"
    torch.save({**ref, "transformer.core_block.0.attn.c_qq.weight": torch.zeros(2)}, bad_key)

    one_line_error(capsys, ["convert", "--from-official", tmp_path / "nope.pt", "--config", config_json, "--out",
                            tmp_path / "r1"], "nope.pt: no such file")
    one_line_error(capsys, ["convert", "--from-official", good, "--config", tmp_path / "nope.json", "--out",
                            tmp_path / "r2"], "no such config file")
    one_line_error(capsys, ["convert", "--from-official", good, "--out", tmp_path / "r3"], "needs --config")
    one_line_error(capsys, ["convert", "--from-official", bad_key, "--config", config_json, "--out",
                            tmp_path / "r4"], "'transformer.core_block.0.attn.c_qq.weight'")
    yaml_cfg = REPO / "configs/parcae-tiny.yaml"
    one_line_error(capsys, ["convert", "--from-official", good, "--config", yaml_cfg, "--out", tmp_path / "r5"],
                   "YAML")
    one_line_error(capsys, ["convert", "--to-official", trained_checkpoint, "--out", tmp_path / "x.npz"],
                   "unknown output type")
    one_line_error(capsys, ["convert", "--to-official", tmp_path / "missing", "--out", tmp_path / "x.pt"],
                   "no such directory")
    one_line_error(capsys, ["export", tmp_path / "missing", "--out", tmp_path / "x.safetensors"],
                   "no such directory")
    one_line_error(capsys, ["export", trained_checkpoint, "--out", tmp_path / "x.bin"], ".safetensors")
    assert not any((tmp_path / f"r{i}").exists() for i in range(1, 6))


@pytest.mark.parametrize("mutate,needle", [
    (lambda sd: sd.update({"transformer.core_block.0.attn.c_qq.weight": torch.zeros(1)}), "c_qq"),
    (lambda sd: sd.pop("transformer.coda.0.mlp.fc.weight"), "missing keys 'transformer.coda.0.mlp.fc.weight'"),
    (lambda sd: sd.update({"transformer.core_block.2.norm_1.weight": torch.ones(128)}), "model.n_core=2"),
    (lambda sd: sd.update({"transformer.wte.weight": torch.zeros(4096, 128)}), "model.vocab_size x model.d_model"),
    (lambda sd: sd.update({"lm_head.weight": torch.zeros(512, 128)}), "lm_head.weight differs"),
    (lambda sd: sd.update({"step": 3}), "'step' holds a int"),
    (lambda sd: sd.update({"transformer.C.weight": torch.zeros(128, 128, dtype=torch.complex64)}), "complex64"),
])
def test_official_to_checkpoint_refuses_weights_that_do_not_fit(tiny, tmp_path, mutate, needle):
    cfg, _, ref = tiny
    ref = dict(ref)
    mutate(ref)
    with pytest.raises(ConversionError) as info:
        official_to_checkpoint(ref, cfg.to_dict(), tmp_path / "root")
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "root").exists()


def test_official_to_checkpoint_never_writes_into_a_used_directory(tiny, tmp_path):
    cfg, _, ref = tiny
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "latest").write_text("step_00000001\n")
    with pytest.raises(CheckpointError, match="not an empty directory"):
        official_to_checkpoint(ref, cfg.to_dict(), tmp_path / "root")
    with pytest.raises(CheckpointError, match="no 'model' section"):
        official_to_checkpoint(ref, {"optim": {}}, tmp_path / "other")


def test_checkpoint_to_official_refuses_arrays_without_an_official_name(tmp_path):
    with Checkpointer(tmp_path, async_save=False, file_writer=fast_write) as saver:
        saver.save(1, [Piece("model/embed.weight", (4, 2), (0, 0), torch.ones(4, 2)),
                       Piece("model/extra_head.weight", (4, 2), (0, 0), torch.ones(4, 2))], {"config": {}})
    with pytest.raises(ConversionError, match="extra_head.weight"):
        checkpoint_to_official(tmp_path / "step_00000001")


def test_export_refuses_to_overwrite_unless_told(trained_checkpoint, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"an earlier export")
    one_line_error(capsys, ["export", trained_checkpoint, "--out", out], "pass --overwrite")
    assert out.read_bytes() == b"an earlier export"
    (tmp_path / "other.json").write_text("{}")  # the sidecar of another --out is an existing file too
    one_line_error(capsys, ["export", trained_checkpoint, "--out", tmp_path / "other.safetensors"], "other.json")
    assert main(["export", str(trained_checkpoint), "--out", str(out), "--overwrite"]) == 0  # the advice, followed
    assert out.read_bytes() != b"an earlier export" and json.loads(out.with_suffix(".json").read_text())["step"] == 5
