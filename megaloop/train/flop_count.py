"""The FLOP model checked against a counter: one training forward + backward of a real model under
torch.utils.flop_counter.FlopCounterMode, its per-module counts grouped into the FLOP model's components.

Attention runs through the "math" kernel here (explicit QK^T and AV products, which the counter sees as bmm and
counts whole: the full convention); the linear layers are mm. Groups: prelude, injection (RDM: with W_1 h of every
lap), laps (the core blocks over all laps), coda (C and the coda blocks), head (the tied d x V matmul, run by the
model itself), attention (every bmm, in any block), all forward; and the whole backward. Used by tests/train/test_flop_count.py (a cheap subset) and
benchmarks/flops_counter.py (the whole matrix).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import torch

from megaloop.config.model import ModelConfig
from megaloop.train.flops import FlopModel

GROUPS = ("prelude", "injection", "laps", "coda", "head", "attention", "backward")


def analytical_groups(cfg: ModelConfig, n: int, k: int) -> dict[str, float]:
    """The FLOP model's per-token forward FLOPs summed into GROUPS (full attention: the math kernel computes every
    pair of the row, document-masked or not), and the whole backward."""
    fm = FlopModel.of(replace(cfg, doc_mask=False))
    out = dict.fromkeys(GROUPS, 0.0)
    for c in fm.components(n, k):
        group = "laps" if c.name.startswith("lap ") else "prelude" if c.name == "blocks" else c.name
        share = 1.0 if c.name.endswith("(no grad)") else 1 / 3  # forward: 2 of a trained matmul's 6 per parameter
        out[group] += share * c.matmul
        out["attention"] += share * c.attention
        out["backward"] += (1 - share) * c.total
    if cfg.injection == "concat":  # W_1 h runs inside the injection module every lap
        per_lap = 2 * cfg.d_model * cfg.d_model * (n + k)
        out["injection"] += per_lap
        out["laps"] -= per_lap
    return out


def counted_groups(model, cfg: ModelConfig, n: int, k: int, batch: int = 2, seed: int = 0) -> dict[str, float]:
    """Per-token FLOPs counted by FlopCounterMode at n laps without and k with gradient (GPT: one pass): the
    forward per module, grouped as GROUPS, and the whole backward. The backward is counted whole because the
    counter's module tracker attributes the backward of a module called more than once (the core, every lap) to
    the wrong modules; per lap it is checked by comparing depths (benchmarks/flops_counter.py). The model's
    attention layers are switched to the math kernel."""
    from torch.utils.flop_counter import FlopCounterMode

    from megaloop.model.attention import set_attention_backend

    set_attention_backend(model, "math")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
    kwargs = {"depth": n + k, "backprop_depth": k} if cfg.is_looped else {}
    forward, backward = FlopCounterMode(display=False), FlopCounterMode(display=False)
    with forward:
        out = model(ids[:, :-1], ids[:, 1:], **kwargs)
    with backward:
        out.loss.backward()
    model.zero_grad(set_to_none=True)
    tokens = batch * cfg.seq_len
    groups = _group(forward.get_flop_counts(), type(model).__name__, tokens, cfg.is_looped)
    groups["backward"] = backward.get_total_flops() / tokens
    return groups


def _group(counts: dict, root: str, tokens: int, looped: bool) -> dict[str, float]:
    out = defaultdict(float)
    children = {"prelude": "prelude", "injection": "injection", "core": "laps", "C": "coda", "coda": "coda"}
    if not looped:
        children = {"prelude": "prelude", "core": "prelude", "coda": "prelude"}  # one plain stack
    inside = 0.0
    for name, ops in counts.items():  # the root's direct children (a block list's items: "root.core.0")
        parts = name.split(".")
        if parts[0] != root or len(parts) < 2 or parts[1] not in children:
            continue
        if parts[1] in ("prelude", "core", "coda") and len(parts) != 3:
            continue  # a block's own children are inside the block's count
        if parts[1] not in ("prelude", "core", "coda") and len(parts) != 2:
            continue
        for op, flops in ops.items():
            out["attention" if "bmm" in str(op) else children[parts[1]]] += flops / tokens
            inside += flops
    out["head"] += (sum(counts.get(root, {}).values()) - inside) / tokens  # what the root runs itself: the head
    return {g: out[g] for g in GROUPS if g != "backward"}


def compare(cfg: ModelConfig, n: int, k: int, model=None) -> list[tuple[str, float, float, float]]:
    """(group, analytical, counted, relative error) per group with any FLOPs, per token."""
    from megaloop.model import build_model

    if model is None:
        model = build_model(cfg).float()
    want, got = analytical_groups(cfg, n, k), counted_groups(model, cfg, n, k)
    rows = []
    for name in GROUPS:
        if want[name] or got[name]:
            rows.append((name, want[name], got[name], abs(got[name] - want[name]) / max(want[name], 1e-30)))
    return rows
