"""A ring-pipeline rank builds the model on the meta device and materialises only its stage's parameters
(megaloop.model.stages.stage_parameter_names + megaloop/train/build.py held_parameters(names=...)).

parcae-tiny with 4 core blocks at pp 2 and 4, fp32 and fp64: every parameter a stage holds is bit-identical to the
eager single-process build's, every other one is still on the meta device (allocating nothing), the stages together
hold every parameter and share only the tied embedding. With hand-made tensor-parallel shard specs on top, a stage
holds exactly the shards of its own parameters. stage_parameter_names equals, for every case of the ring stage test
(parcae, RDM and GPT at pp 2 and 4), the owner sets that test checks against each rank's nonzero gradients under the
ring executor, so the names are the parameters the stage program actually uses.

The trainer's own build (build_model_and_optimizer with make_runtime's runtime) on 4 processes under pp2 x tp2 (fp64
and fp32), pp2 x dp2 and pp4 (fp64): every rank holds exactly its stage's parameters (stage_parameter_names), none of
them on meta and nothing else allocated, and its parameters gathered over tp are bit-identical to a single-process
eager build with the same seed; the stages together hold every parameter, the tied embedding on the first and last.
benchmarks/build_layouts.py runs the whole matrix (pp2 and pp2 x tp2 x dp2 too, on 1 and 2 threads)."""
from __future__ import annotations

import pytest
import torch

from megaloop.config import load_config
from megaloop.model import build_model
from megaloop.model.stages import stage_parameter_names
from megaloop.train.build import held_parameters
from pipeline.tensor_parallel import ShardSpec, TensorParallelInfo, shard_tensor
from tests.pipeline.spawn import spawn
from tests.pipeline.test_ring_looped import CASES, expected_owners
from tests.pipeline.workers_build import build_worker, holder_counts, rank_findings
from tests.pipeline.workers_ring import TINY, build

SEED = 5
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def tiny_cfg():
    return load_config(TINY, ["model.n_core=4"]).model


def stage_model(cfg, stage: int, pp: int, dtype: torch.dtype, tp_info=None):
    """A meta build holding only stage `stage`'s parameters (this rank's shards of them under tp_info)."""
    model = build_model(cfg, device="meta").to(dtype)
    names = stage_parameter_names(model, stage, pp)
    held_parameters(cfg, SEED, torch.device("cpu"), names=names)(model, tp_info or TensorParallelInfo())
    return model, names


def held_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)


@pytest.mark.parametrize("precision", sorted(DTYPES))
@pytest.mark.parametrize("pp", [2, 4])
def test_stage_build_equals_eager_build(pp, precision):
    cfg, dtype = tiny_cfg(), DTYPES[precision]
    eager = build_model(cfg, seed=SEED).to(dtype)
    reference = dict(eager.named_parameters())
    total = held_bytes(eager)
    seen: dict[str, int] = {}
    for stage in range(pp):
        model, names = stage_model(cfg, stage, pp, dtype)
        params = dict(model.named_parameters())
        equal = sum(torch.equal(params[n], reference[n]) for n in names)
        meta = [n for n, p in params.items() if p.is_meta]
        print(f"pp={pp} {precision} stage {stage}: {equal}/{len(names)} held parameters bit-identical to the eager "
              f"build, {len(meta)} on meta; holds {held_bytes(model):,} of {total:,} bytes "
              f"({held_bytes(model) / total:.3f})")
        assert equal == len(names) and sorted(meta) == sorted(set(params) - set(names))
        assert torch.equal(model.rope_cos, eager.rope_cos) and torch.equal(model.rope_sin, eager.rope_sin)
        for n in names:
            seen[n] = seen.get(n, 0) + 1
    assert set(seen) == set(reference)
    assert {n for n, count in seen.items() if count > 1} == {"embed.weight"}


def test_stage_build_composes_with_tensor_parallel_shards():
    """Split every matrix's first dimension over tp 2 by hand (the meta parameters take the local shape, as a
    tensor-parallel split leaves them): stage 1 of 2 on tp rank 1 holds exactly the eager build's rank-1 shards of its
    own parameters, and nothing of the others."""
    cfg = tiny_cfg()
    eager = dict(build_model(cfg, seed=SEED).named_parameters())
    model = build_model(cfg, device="meta")
    shards = {}
    for name, p in list(model.named_parameters()):
        if p.dim() == 2:
            shards[name] = ShardSpec(dim=0, tp=2)
            module_name, _, leaf = name.rpartition(".")
            local = torch.nn.Parameter(torch.empty(p.shape[0] // 2, p.shape[1], device="meta"))
            setattr(model.get_submodule(module_name), leaf, local)
    names = stage_parameter_names(model, 1, 2)
    held_parameters(cfg, SEED, torch.device("cpu"), names=names)(model, TensorParallelInfo(tp=2, tp_rank=1,
                                                                                           shards=shards))
    params = dict(model.named_parameters())
    for n in names:
        want = shard_tensor(eager[n], shards[n], 1) if n in shards else eager[n]
        assert torch.equal(params[n], want), n
    assert all(params[n].is_meta for n in set(params) - set(names))
    assert any(n in shards for n in names) and any(n not in shards for n in names)


@pytest.mark.parametrize("pp", sorted(CASES))
def test_stage_names_are_what_the_ring_stages_use(pp):
    for case in CASES[pp]:
        model = build(case)[0]
        owners = expected_owners(model, pp)
        for stage in range(pp):
            names = stage_parameter_names(model, stage, pp)
            assert len(names) == len(set(names)) and set(names) == owners[stage], (case, stage)


def test_stage_names_and_held_parameters_refuse_bad_input():
    cfg = tiny_cfg()
    model = build_model(cfg, device="meta")
    assert stage_parameter_names(model, 0, 1) == [n for n, _ in model.named_parameters()]
    with pytest.raises(ValueError, match="stage must be in 0..1"):
        stage_parameter_names(model, 2, 2)
    with pytest.raises(ValueError, match="more pipeline stages than core blocks"):
        stage_parameter_names(model, 0, 5)
    with pytest.raises(ValueError, match="not parameters of this model: \\['core.9.mlp.fc.weight'\\]"):
        held_parameters(cfg, SEED, torch.device("cpu"), names=["core.9.mlp.fc.weight"])(model, TensorParallelInfo())


TRAINER_LAYOUTS = {"pp2xtp2 fp64": (2, 2, "fp64"), "pp2xtp2 fp32": (2, 2, "fp32"), "pp2xdp2 fp64": (2, 1, "fp64"),
                   "pp4 fp64": (4, 1, "fp64"), "tp2xdp2 fp32": (1, 2, "fp32"), "dp4 fp32": (1, 1, "fp32")}
# the data-parallel ranks of a layout deal the init between them and broadcast it (megaloop.train.build.InitSplit)


def trainer_overrides(pp: int, tp: int, precision: str) -> list[str]:
    """parcae-tiny with 4 core blocks, vocabulary 512, on 4 processes (dp = 4 / (pp x tp)); 4 rows a step in
    micro-batches of 1, enough for pp 4."""
    return ["model.n_core=4", "model.vocab_size=512", "model.seq_len=32", f"train.seed={SEED}",
            f"train.precision={precision}", f"parallel.pp={pp}", f"parallel.tp={tp}", "data.micro_batch_size=1",
            "data.global_batch_size=4"]


def check_trainer_build(label: str, reports: list[dict], eager: dict, stage_names: list[list[str]]) -> None:
    """Every rank's report (rank order) against the eager build and the stage names; see the module docstring."""
    for rank, r in enumerate(reports):
        found = rank_findings(r, eager, stage_names[r["stage"]])
        print(f"{label} rank {rank} (stage {r['stage']}, tp rank {r['tp_rank']}, dp rank {r['dp_rank']}): holds "
              f"{found['held']} parameters, its stage's names {found['names']}, nothing else allocated "
              f"{found['only_held']}; {found['equal']} bit-identical to the eager build (gathered over tp)")
        assert found["names"] and found["only_held"] and found["equal"] == found["held"], (label, rank)
    holders = holder_counts(reports)
    per_stage = len(reports) // reports[0]["pp"]  # ranks holding one stage (tp x dp)
    assert set(holders) == set(eager), label
    if reports[0]["pp"] == 1:
        assert set(holders.values()) == {per_stage}, label
        return
    assert {n for n, count in holders.items() if count != per_stage} == {"embed.weight"}, label
    assert holders["embed.weight"] == 2 * per_stage, label


@pytest.mark.multiproc
def test_trainer_build_holds_its_stage_bit_identical_to_the_eager_build(tmp_path):
    runs = {label: trainer_overrides(pp, tp, precision) for label, (pp, tp, precision) in TRAINER_LAYOUTS.items()}
    spawn(build_worker, 4, str(TINY), runs, str(tmp_path / "build"))
    reports = [torch.load(f"{tmp_path / 'build'}.{rank}") for rank in range(4)]
    cfg = load_config(TINY, runs["pp4 fp64"]).model
    meta = build_model(cfg, device="meta")
    for label, (pp, _, precision) in TRAINER_LAYOUTS.items():
        eager = dict(build_model(cfg, seed=SEED).to(DTYPES[precision]).named_parameters())
        stage_names = [stage_parameter_names(meta, stage, pp) for stage in range(pp)]
        check_trainer_build(label, [r[label] for r in reports], eager, stage_names)
