"""Which block linear layers train.fp8 can convert, from the config alone (no torch): checked before any work.

An FP8 GEMM needs both dimensions of a layer's weight shard to be multiples of 16 (pipeline/fp8.py ALIGN; the
same holds for Transformer Engine's FP8 GEMMs), so a model whose every block layer misses that would train in bf16
while the run header said FP8. The shapes here mirror megaloop/model/block.py and attention.py; tensor parallelism
splits q, k, v and the MLP's fc by output (column) and proj by input (row).
"""
from __future__ import annotations

ALIGN = 16


def block_linear_shapes(model, tp: int = 1) -> dict[str, tuple[int, int]]:
    """Role -> (in, out) of one block's linear layers as a tensor-parallel rank holds them (ve_gate only when the
    model has value embeddings: some blocks carry it)."""
    d, hd = model.d_model, model.head_dim
    fc_out = model.ffn_hidden * (2 if model.mlp == "swiglu" else 1)
    shapes = {
        "attn.q": (d, model.n_heads * hd // tp),
        "attn.k": (d, model.kv_heads * hd // tp),
        "attn.v": (d, model.kv_heads * hd // tp),
        "attn.proj": (model.n_heads * hd // tp, d),
        "mlp.fc": (d, fc_out // tp),
        "mlp.proj": (model.ffn_hidden // tp, d),
    }
    if model.value_embeds:
        shapes["attn.ve_gate"] = (model.ve_gate_channels, model.kv_heads)
    return shapes


def fp8_eligible(model, tp: int = 1) -> list[str]:
    """The roles whose layers can run in FP8 (both dimensions multiples of ALIGN)."""
    return [role for role, (k, n) in block_linear_shapes(model, tp).items() if k % ALIGN == 0 and n % ALIGN == 0]


def no_fp8_layer_reason(model, tp: int = 1) -> str | None:
    """None when some block layer can run in FP8; else what the widths are and what they need."""
    if fp8_eligible(model, tp):
        return None
    shapes = ", ".join(f"{role} {k}->{n}" for role, (k, n) in block_linear_shapes(model, tp).items())
    split = f" per tensor-parallel rank (parallel.tp={tp})" if tp > 1 else ""
    return (f"no linear layer of the blocks can run in FP8: their widths{split} are {shapes}, and an FP8 GEMM needs "
            f"both dimensions to be multiples of {ALIGN}; use a model.d_model (and model.mlp_hidden) that is a "
            f"multiple of {ALIGN * max(tp, 1)}, or train.fp8=none")
