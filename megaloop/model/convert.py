"""Weight conversion between the official Parcae implementation's state_dict layout and ours.

Reference keys (PARCAE_REFERENCE.md section 9): transformer.wte.weight, transformer.{prelude|core_block|coda}.{i}.
{norm_1, attn.c_q, attn.c_k, attn.c_v, attn.c_proj, attn.ve_gate, norm_2, mlp.fc, mlp.proj}.weight,
transformer.adapter.{A_log, dt_bias, B} (diagonal) or transformer.adapter.adapter.weight (linear/concat),
transformer.C.weight, transformer.ln_f.weight, transformer.ln_prelude.weight, value_embeds.{k}.weight,
lm_head.weight (the same tensor as wte) and the freqs_cis buffer (regenerated, so ignored).
Every load is strict: unknown, missing or mis-shaped keys raise an error naming them. The key names themselves
are checkpoints.official's; this module adds the checks that need the model (every shape from the config).
"""
from __future__ import annotations

import torch

from checkpoints.official import (
    TIED_HEAD_KEY,
    ConversionError,
    megaloop_to_official_key,
    official_to_megaloop_name,
    strip_wrappers,
)
from megaloop.config.model import ModelConfig

__all__ = ["ConversionError", "from_reference_state_dict", "ours_to_reference_key", "reference_to_ours_key",
           "to_reference_state_dict"]

# The pure name mapping lives in checkpoints.official (shared with `python -m checkpoints convert`).
reference_to_ours_key = official_to_megaloop_name
ours_to_reference_key = megaloop_to_official_key
_strip = strip_wrappers


def _expected_shapes(model_config: ModelConfig) -> dict[str, torch.Size]:
    from megaloop.model import build_model

    meta = build_model(model_config, device="meta")
    return {k: v.shape for k, v in meta.state_dict().items()}


def from_reference_state_dict(state_dict: dict, model_config: ModelConfig) -> dict[str, torch.Tensor]:
    """The reference's state_dict -> ours, strictly: every key must be known, present and of the right shape."""
    expected = _expected_shapes(model_config)
    out: dict[str, torch.Tensor] = {}
    problems: list[str] = []
    head = None
    for key, tensor in state_dict.items():
        try:
            ours = reference_to_ours_key(key)
        except ConversionError as err:
            problems.append(str(err))
            continue
        if _strip(key) == TIED_HEAD_KEY:
            head = tensor
        if ours is None:
            continue
        if ours not in expected:
            problems.append(f"reference key {key!r} (ours {ours!r}) does not exist in this model config")
        elif tuple(tensor.shape) != tuple(expected[ours]):
            problems.append(f"reference key {key!r}: shape {tuple(tensor.shape)}, expected {tuple(expected[ours])}")
        else:
            out[ours] = tensor
    missing = sorted(set(expected) - set(out))
    if missing:
        problems.append("missing reference keys: " + ", ".join(ours_to_reference_key(k) for k in missing))
    if head is not None and "embed.weight" in out and not torch.equal(head, out["embed.weight"]):
        problems.append("lm_head.weight differs from transformer.wte.weight, but the model ties them")
    if problems:
        raise ConversionError("cannot convert the reference state_dict:\n  " + "\n  ".join(problems))
    return out


def to_reference_state_dict(state_dict: dict, model_config: ModelConfig) -> dict[str, torch.Tensor]:
    """Ours -> the reference's key names (lm_head.weight is the same tensor as transformer.wte.weight)."""
    expected = _expected_shapes(model_config)
    unknown = sorted(set(state_dict) - set(expected))
    missing = sorted(set(expected) - set(state_dict))
    if unknown or missing:
        raise ConversionError(f"state_dict does not match the model config: unknown {unknown}, missing {missing}")
    out = {ours_to_reference_key(k): v for k, v in state_dict.items()}
    out[TIED_HEAD_KEY] = out[ours_to_reference_key("embed.weight")]
    return out
