"""Parameter counts of the built configs equal the reference table, counted on the meta device."""
from pathlib import Path

import pytest
import torch

from megaloop.config import load_config
from megaloop.model import build_model, count_parameters

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
REFERENCE_MILLIONS = {
    "parcae-140m": 144.32, "parcae-370m": 388.00, "parcae-770m": 776.66, "parcae-1_3b": 1338.59,
    "gpt-140m": 143.14, "gpt-370m": 385.90, "gpt-770m": 773.38, "gpt-1_3b": 1333.87,
}


@pytest.mark.parametrize("name,expected", sorted(REFERENCE_MILLIONS.items()))
def test_parameter_count_matches_reference(name, expected):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    model = build_model(cfg.model, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters()), "counting must not allocate"
    millions = count_parameters(model) / 1e6
    print(f"{name}: {millions:.2f}M (reference {expected:.2f}M)")
    assert abs(millions - expected) <= 0.01


def test_value_embedding_tables_and_tied_head():
    cfg = load_config(CONFIGS / "parcae-140m.yaml")
    model = build_model(cfg.model, device="meta")
    assert sorted(model.value_embeds.keys(), key=int) == ["1", "3", "5"]
    ve = sum(p.numel() for p in model.value_embeds.parameters())
    assert round(ve / 1e6, 2) == 75.50
    assert round(model.embed.weight.numel() / 1e6, 2) == 25.17
    names = [n for n, _ in model.named_parameters()]
    assert not any("lm_head" in n for n in names), "the head is tied to the embedding"


def test_counting_does_not_allocate_memory():
    cfg = load_config(CONFIGS / "parcae-1_3b.yaml")
    model = build_model(cfg.model, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert isinstance(model.embed.weight, torch.Tensor)
