"""The explicit tensor-parallel modules: at tp 2 (fp64, with and without sequence parallelism) each parallel module
holds the shard its ShardSpec names and gives the whole module's output cut the way its rank should see it
(within 1e-12); a split model keeps its parameter names, has no forward hooks and no method set on an instance,
follows ParallelLM's train/eval, and draws under sequence parallelism the slice of the single-process h_0."""
from __future__ import annotations

import pytest
import torch

from megaloop.model import build_model
from pipeline.tensor_parallel import ShardSpec
from tests.pipeline.models import case_config
from tests.pipeline.spawn import spawn
from tests.pipeline.workers_tp_modules import worker

TOL = 1e-12
EXPECTED = {  # style: (class, ShardSpec of m.weight at tp 2; None: replicated)
    "column": ("ColumnParallelLinear", ShardSpec(0, 2)),
    "row": ("RowParallelLinear", ShardSpec(1, 2)),
    "vocab": ("VocabParallelEmbedding", ShardSpec(0, 2)),
    "column-embedding": ("ColumnParallelEmbedding", ShardSpec(1, 2)),
    "enter": ("ColumnRegionInputScale", None),
    "gather-output": ("ColumnRegionOutputScale", None),
}
MODEL_CLASSES = {"embed": "VocabParallelEmbedding", "value_embeds.1": "ColumnParallelEmbedding",
                 "core.0.attn": "ColumnRegionInputAttention", "core.0.attn.q": "ColumnParallelLinear",
                 "core.0.attn.ve_gate": "ColumnParallelLinear", "core.0.attn.proj": "RowParallelLinear",
                 "core.0.mlp": "ColumnRegionInputSwiGLUMLP", "core.0.mlp.fc": "ColumnParallelLinear",
                 "core.0.mlp.proj": "RowParallelLinear", "final_norm": "ColumnRegionOutputRMSNorm",
                 "core.0.norm_1": "RMSNorm", "injection": "DiagonalInjection"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_modules") / "results.pt"
    spawn(worker, 2, str(out))
    return torch.load(out)


@pytest.mark.multiproc
@pytest.mark.parametrize("sp", [False, True])
def test_parallel_modules_equal_whole_modules(results, sp):
    for style, got in results[("modules", sp)].items():
        cls, spec = EXPECTED[style]
        print(f"sp={sp} {style}: {got['cls']}, |out - whole module's| {got['err']:.1e}, shard err {got['shard_err']}")
        assert got["cls"] == cls and got["is_base"]
        assert got["names"] == ["m.weight"]
        assert {n: ShardSpec(*t) for n, t in got["shards"].items()} == ({"m.weight": spec} if spec else {})
        assert got["err"] <= TOL and got["shard_err"] == 0.0
    assert results[("modules", sp)]["vocab"]["vocab_range"] == (0, 5)


@pytest.mark.multiproc
@pytest.mark.parametrize("sp", [False, True])
def test_split_model_is_explicit(results, sp):
    got = results[("model", sp)]
    cfg = case_config("parcae-gqa-swiglu")
    print(f"sp={sp}: h_0 {got['h0_shape']}, |h_0 - single-process slice| {got['h0_err']:.1e}")
    assert got["names_kept"] and got["same_params"]
    assert got["hooks"] == 0 and got["patched"] == []
    assert {n: got["classes"][n] for n in MODEL_CLASSES} == MODEL_CLASSES
    assert got["eval_modes"] == {False} and got["train_mode"]
    assert got["h0_shape"] == (2, cfg.seq_len // 2 if sp else cfg.seq_len, cfg.d_model)
    assert got["h0_err"] == 0.0


@pytest.mark.multiproc
def test_unsupported_split_is_refused(results):
    assert "cannot split a Embedding" in results["refused"] and "row on nn.Linear" in results["refused"]


def test_sequence_shard_arguments_are_checked():
    model = build_model(case_config("parcae"), device="meta")
    for parts, shard in ((2, None), (1, lambda full: full), (0, None)):
        with pytest.raises(ValueError, match="set_sequence_shard"):
            model.set_sequence_shard(parts, shard)
