"""Weight conversion between the official Parcae implementation's state_dict layout and ours.

Reference keys (PARCAE_REFERENCE.md section 9): transformer.wte.weight, transformer.{prelude|core_block|coda}.{i}.
{norm_1, attn.c_q, attn.c_k, attn.c_v, attn.c_proj, attn.ve_gate, norm_2, mlp.fc, mlp.proj}.weight,
transformer.adapter.{A_log, dt_bias, B} (diagonal) or transformer.adapter.adapter.weight (linear/concat),
transformer.C.weight, transformer.ln_f.weight, transformer.ln_prelude.weight, value_embeds.{k}.weight,
lm_head.weight (the same tensor as wte) and the freqs_cis buffer (regenerated, so ignored).
Every load is strict: unknown, missing or mis-shaped keys raise an error naming them.
"""
from __future__ import annotations

import re

import torch

from megaloop.config.model import ModelConfig

_STACKS = {"prelude": "prelude", "core_block": "core", "coda": "coda"}
_BLOCK_PARTS = {
    "norm_1.weight": "norm_1.weight", "norm_2.weight": "norm_2.weight",
    "norm_3.weight": "norm_3.weight", "norm_4.weight": "norm_4.weight",
    "attn.c_q.weight": "attn.q.weight", "attn.c_k.weight": "attn.k.weight", "attn.c_v.weight": "attn.v.weight",
    "attn.c_proj.weight": "attn.proj.weight", "attn.ve_gate.weight": "attn.ve_gate.weight",
    "mlp.fc.weight": "mlp.fc.weight", "mlp.proj.weight": "mlp.proj.weight",
}
_FIXED = {
    "transformer.wte.weight": "embed.weight",
    "transformer.adapter.A_log": "injection.A_log",
    "transformer.adapter.dt_bias": "injection.dt_bias",
    "transformer.adapter.B": "injection.B",
    "transformer.adapter.adapter.weight": "injection.W.weight",
    "transformer.C.weight": "C.weight",
    "transformer.ln_f.weight": "final_norm.weight",
    "transformer.ln_prelude.weight": "prelude_norm.weight",
}
_IGNORED = ("freqs_cis",)
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


class ConversionError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; show it plainly
        return str(self.args[0])


def _strip(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix):], True
    return key.replace("._orig_mod.", ".")


def reference_to_ours_key(key: str) -> str | None:
    """Our name for a reference key; None for keys that carry no weights (lm_head, buffers)."""
    key = _strip(key)
    if key in _IGNORED or key == "lm_head.weight":
        return None
    if key in _FIXED:
        return _FIXED[key]
    m = re.fullmatch(r"transformer\.(prelude|core_block|coda)\.(\d+)\.(.+)", key)
    if m and m.group(3) in _BLOCK_PARTS:
        return f"{_STACKS[m.group(1)]}.{m.group(2)}.{_BLOCK_PARTS[m.group(3)]}"
    if re.fullmatch(r"value_embeds\.\d+\.weight", key):
        return key
    raise ConversionError(f"unknown reference key {key!r}: not a Parcae parameter this converter knows")


def ours_to_reference_key(key: str) -> str:
    inverse_fixed = {v: k for k, v in _FIXED.items()}
    if key in inverse_fixed:
        return inverse_fixed[key]
    inverse_stacks = {v: k for k, v in _STACKS.items()}
    inverse_parts = {v: k for k, v in _BLOCK_PARTS.items()}
    m = re.fullmatch(r"(prelude|core|coda)\.(\d+)\.(.+)", key)
    if m and m.group(3) in inverse_parts:
        return f"transformer.{inverse_stacks[m.group(1)]}.{m.group(2)}.{inverse_parts[m.group(3)]}"
    if re.fullmatch(r"value_embeds\.\d+\.weight", key):
        return key
    raise ConversionError(f"our key {key!r} has no reference counterpart")


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
        if _strip(key) == "lm_head.weight":
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
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out
