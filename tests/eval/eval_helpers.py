"""A small random-weight LoopedLM saved as a committed checkpoint, and a byte-level tokenizer, for eval tests."""
from __future__ import annotations

import dataclasses

import torch

from megaloop.config import ModelConfig
from megaloop.model import build_model


def small_model(seed: int = 1, **overrides):
    base = dict(arch="parcae", vocab_size=260, d_model=32, n_heads=2, n_prelude=1, n_core=2, n_coda=1, seq_len=24,
                mu_rec=3, mu_bwd=1, ve_gate_channels=8)
    base.update(overrides)
    cfg = ModelConfig(**base)
    model = build_model(cfg, device="cpu", seed=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the reference init zeroes output projections; give every weight a value
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def save_checkpoint(model, root, step: int = 5, seed: int = 0):
    """Commit `model`'s parameters under `root` the way training does (model/<name> arrays, config in metadata)."""
    from checkpoints import Checkpointer, Piece

    config = {"model": dataclasses.asdict(model.cfg), "train": {"seed": seed}, "data": {"shards": str(root)}}
    pieces = [Piece("model/" + n, tuple(p.shape), (0,) * p.dim(), p.detach().clone())
              for n, p in model.named_parameters()]
    with Checkpointer(root, rank=0, world_size=1, async_save=False, keep=1) as saver:
        saver.save(step, pieces, {"config": config, "tokens": 0})
        result = saver.wait()
    assert result is not None and result.ok
    return result.path


class ByteTokenizer:
    """Token = UTF-8 byte + 3; 0 BOS, 1 EOS, 2 PAD (fits a vocabulary of 260)."""

    bos_id, eos_id, pad_id = 0, 1, 2

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")
