"""build_model follows the ambient default device when no device is given (torchtitan's idiom for counting a model
is `with torch.device("meta"): build_model(cfg)`), and computes the same reference values whatever that device is."""
import torch

from megaloop.config import load_config
from megaloop.model import build_model, count_parameters

CFG = load_config(None, ["model.d_model=64", "model.n_heads=2", "model.vocab_size=256", "model.seq_len=32",
                         "model.ve_gate_channels=16"], validate=False).model


def test_ambient_meta_device_builds_a_meta_model():
    with torch.device("meta"):
        model = build_model(CFG)
    explicit = build_model(CFG, device="meta")
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())
    assert count_parameters(model) == count_parameters(explicit) == count_parameters(build_model(CFG)) > 0


def test_ambient_cpu_device_builds_the_same_bits():
    with torch.device("cpu"):
        ambient = dict(build_model(CFG, seed=3).named_parameters())
    plain = dict(build_model(CFG, seed=3).named_parameters())
    assert ambient.keys() == plain.keys()
    assert all(torch.equal(ambient[k], plain[k]) and ambient[k].device.type == "cpu" for k in plain)


def test_explicit_device_wins_over_the_ambient_one():
    with torch.device("meta"):
        model = build_model(CFG, device="cpu", seed=3)
    plain = dict(build_model(CFG, seed=3).named_parameters())
    assert all(torch.equal(p, plain[k]) for k, p in model.named_parameters())
