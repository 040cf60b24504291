"""The tensor-parallel plan of the looped LM, as data: module-name patterns -> how the module is split.

`pipeline.tensor_parallel.apply_tensor_parallel` applies a plan to a built model (the model itself knows nothing of
parallelism) by swapping each module a split or region style names for an explicit parallel module that holds the
same parameters under the same names (the class each style becomes is in brackets). Patterns are fnmatch patterns
over qualified module names (`*` also matches dots); every matching rule applies, and every parameter must be
covered by some rule. Styles:

  vocab                        nn.Embedding split along vocabulary rows; the tied head reuses the same shard, so
                               the logits come out split along the vocabulary (vocab-parallel cross-entropy)
                               [VocabParallelEmbedding]
  column                       output features split (Linear: weight rows; Embedding: embedding columns); no comm
                               [ColumnParallelLinear, ColumnParallelEmbedding]
  column-paired                like column, for a Linear whose output is two halves [gate; up] chunked in forward:
                               each half is split, so a rank holds [gate_r; up_r] (SwiGLU's fc)
                               [ColumnParallelLinear]
  row                          input features split; the partial outputs are all-reduced, or reduce-scattered
                               along the sequence under sequence parallelism [RowParallelLinear]
  enter                        the module's input enters a column-parallel region: all-gathered along the sequence
                               under sequence parallelism (else: identity forward, all-reduced gradient)
                               [ColumnRegionInput in front of the module's class, e.g. ColumnRegionInputAttention]
  gather-output                the same for the module's output (the final norm feeds the vocab-parallel head)
                               [ColumnRegionOutput in front of the module's class]
  replicate-sequence-parallel  parameters kept whole on every rank; under sequence parallelism the module sees only
                               this rank's positions, so their gradients are summed over the tensor-parallel group

Attention is split by heads: q, k, v (and the value-embedding gate, one row per kv head) are column-parallel, proj
is row-parallel; QK-norm is per head and the module reads head counts from the weights' shapes, so it runs
unchanged on local heads. The value-embedding tables are split along kv heads with k and v. The injection (A_log,
dt_bias, B, concat W), C and the norms stay whole, so h and e are consistent across the group.
"""
from __future__ import annotations

TP_PLAN: tuple[tuple[str, str], ...] = (
    ("embed", "vocab"),
    ("value_embeds.*", "column"),
    ("*.attn", "enter"),
    ("*.attn.q", "column"),
    ("*.attn.k", "column"),
    ("*.attn.v", "column"),
    ("*.attn.ve_gate", "column"),
    ("*.attn.proj", "row"),
    ("*.mlp", "enter"),
    ("*.mlp.fc", "column"),
    ("*.mlp.proj", "row"),
    ("*.norm_*", "replicate-sequence-parallel"),
    ("prelude_norm", "replicate-sequence-parallel"),
    ("injection", "replicate-sequence-parallel"),
    ("injection.*", "replicate-sequence-parallel"),
    ("C", "replicate-sequence-parallel"),
    ("final_norm", "replicate-sequence-parallel"),
    ("final_norm", "gather-output"),
)

# SwiGLU's fc holds [gate; up] and is chunked in two in forward: split each half.
SWIGLU_OVERRIDES: dict[str, str] = {"*.mlp.fc": "column-paired"}


def tensor_parallel_plan(mlp: str = "relu2") -> tuple[tuple[str, str], ...]:
    """The plan for a model whose MLP is `mlp` ("relu2" or "swiglu")."""
    if mlp == "swiglu":
        return tuple((pattern, SWIGLU_OVERRIDES.get(pattern, style)) for pattern, style in TP_PLAN)
    return TP_PLAN
