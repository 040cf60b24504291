"""Which parameter goes to Muon and which to AdamW, decided from parameter names (the reference's rules).

AdamW: the token embedding ``embed.weight`` (tied with the output head, so also ``lm_head.weight``/``head.weight``
if a model exposes the head under its own name), the value-embedding tables ``value_embeds.<k>.weight``, every norm
weight (``...norm_<j>.weight``, ``prelude_norm.weight``, ``final_norm.weight``), the injection's ``A_log``,
``dt_bias`` and ``B``, the coda projection ``C.weight``, and every parameter with fewer than 2 dimensions.
Muon: every other 2-D weight, including ``attn.ve_gate.weight`` and the RDM injection ``injection.W.weight``;
unknown 2-D names default to Muon, unknown < 2-D names to AdamW.

Wrapper components inserted by torch.compile, DDP, FSDP or activation checkpointing (``_orig_mod.``,
``module.`` at the front, ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``) are ignored, and the rules
match a name's tail, so a model nested under a prefix (``model.embed.weight``) is grouped the same way.
"""

from __future__ import annotations

import re
from typing import Iterable, NamedTuple

from torch import Tensor

from .muon import check_matrix

WRAPPER_COMPONENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})

# Tails of parameter names that always go to AdamW, whatever their shape, with the reason (for error messages).
ADAMW_NAME_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (reason, re.compile(r"(?:.*\.)?" + tail))
    for reason, tail in (
        ("token embedding (tied with the head)", r"embed\.weight"),
        ("output head (tied with the embedding)", r"(?:lm_)?head\.weight"),
        ("value embedding", r"value_embeds\.\d+\.weight"),
        ("norm weight", r"(?:[^.]*_)?norm(?:_[^.]*)?\.weight"),
        ("injection decay/step/input (A_log, dt_bias, B)", r"injection\.(?:A_log|dt_bias|B)"),
        ("coda input projection C", r"C\.weight"),
    )
)


def canonical_name(name: str) -> str:
    """Drop wrapper components (torch.compile, DDP, FSDP, checkpointing) from a parameter name."""
    parts = name.split(".")
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(part for part in parts if part not in WRAPPER_COMPONENTS)


def adamw_reason(name: str, ndim: int) -> str | None:
    """Why the parameter goes to AdamW, or None when it goes to Muon."""
    clean = canonical_name(name)
    for reason, pattern in ADAMW_NAME_RULES:
        if pattern.fullmatch(clean):
            return reason
    if ndim < 2:
        return "fewer than 2 dimensions"
    return None


class ParamGroups(NamedTuple):
    """The split: ``muon`` and ``adamw`` are lists of (name, parameter) in the order the model listed them."""

    muon: list[tuple[str, Tensor]]
    adamw: list[tuple[str, Tensor]]

    def summary(self) -> str:
        """One printable line: tensor and element counts per group."""
        parts = []
        for label, members in (("muon", self.muon), ("adamw", self.adamw)):
            numel = sum(param.numel() for _, param in members)
            parts.append(f"{label} {len(members)} tensors / {numel:,} params")
        return "optimizer groups: " + "; ".join(parts)


def split_param_groups(named_params: Iterable[tuple[str, Tensor]], optimizer: str = "muon") -> ParamGroups:
    """Split named parameters into Muon and AdamW lists by the reference's rules.

    ``optimizer="adamw"`` puts every parameter into AdamW. Parameters with requires_grad=False are left out, and
    a tensor listed under two names (a tied weight) is kept once, under its first name. A parameter with more
    than 2 dimensions that the rules would send to Muon raises ValueError (Muon needs matrices).
    """
    if optimizer not in ("muon", "adamw"):
        raise ValueError(f"optimizer = {optimizer!r} is invalid: allowed values are ('muon', 'adamw')")
    muon: list[tuple[str, Tensor]] = []
    adamw: list[tuple[str, Tensor]] = []
    seen: set[int] = set()
    for name, param in named_params:
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        if optimizer == "adamw" or adamw_reason(name, param.ndim) is not None:
            adamw.append((name, param))
        else:
            check_matrix(param.shape, f"parameter {name!r}")
            muon.append((name, param))
    return ParamGroups(muon=muon, adamw=adamw)
