"""The planner under the ring pipeline (pp > 1): stage parameters against the model's own count, the schedule's
costs against hand-computed FLOPs, the simulated figures against a direct simulate() of the same step, and the
command line's checks of an invalid pp."""
import json
from pathlib import Path

import numpy as np
import pytest

from megaloop.config import load_config
from megaloop.depth import make_sampler
from megaloop.model import build_model, count_parameters
from megaloop.plan.gpus import GPUS
from megaloop.plan.planner import make_plan
from pipeline.ring import ring_schedule, simulate

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs/parcae-tiny.yaml"


def _plan(overrides, world, pp=2):
    cfg = load_config(TINY, overrides + [f"parallel.pp={pp}"], world_size=world)
    return cfg, make_plan(cfg, GPUS["h100"], world)


@pytest.mark.parametrize("n_core,pp", [(2, 2), (5, 3), (4, 4)])
def test_stage_parameters_sum_to_the_model_plus_the_tied_embedding(n_core, pp):
    """Every parameter on exactly one stage except the tied embedding (first and last stage); core blocks split
    into consecutive runs differing by at most one, the larger first; fp32 parameters and gradients 4 bytes each."""
    cfg, plan = _plan([f"model.n_core={n_core}", "data.global_batch_size=32", "data.micro_batch_size=2",
                       "train.precision=fp32"], pp, pp)
    total = count_parameters(build_model(cfg.model, device="meta"))
    embed = cfg.model.vocab_size * cfg.model.d_model
    stages = plan.pipeline.stages
    assert sum(st.n_params for st in stages) == total + embed
    blocks = [end - first for first, end in (st.core_blocks for st in stages)]
    assert sum(blocks) == n_core and max(blocks) - min(blocks) <= 1 and min(blocks) >= 1
    assert blocks == sorted(blocks, reverse=True)  # the earlier stages take the extra blocks, as the model's stages
    assert all(st.static.params == st.static.grads == 4 * st.n_params for st in stages)


def test_tensor_parallel_stage_parameters():
    """Under tp 2 each stage holds its tensor-parallel shards: the halves of the split matrices."""
    cfg, one = _plan(["data.global_batch_size=32"], 2)
    _, two = _plan(["data.global_batch_size=32", "parallel.tp=2"], 4)
    for a, b in zip(one.pipeline.stages, two.pipeline.stages):
        assert 0.5 * a.n_params < b.n_params < 0.75 * a.n_params


def test_costs_are_the_hand_computed_flop_ratios():
    """parcae-tiny, pp 2: stage 0 = core block 0 (12 d^2 matmul weights + its 4 x 32 value-embedding gate) and the
    injection's B (d^2); per token forward 2 x weights + 4 d s of attention; prelude = one block; loss = C (d^2),
    the coda block (with a gate) and the head (V d)."""
    cfg, plan = _plan([], 2)
    d, s, v = cfg.model.d_model, cfg.model.seq_len, cfg.model.vocab_size
    attn, gate = 4 * d * s, 4 * 32
    unit = 2 * (12 * d * d + gate + d * d) + attn
    assert unit > 2 * 12 * d * d + attn  # stage 0's segment is the larger one
    costs = plan.pipeline.costs
    assert (costs.forward, costs.backward, costs.nograd_forward) == (1.0, 2.0, 1.0)
    assert costs.embed == pytest.approx((2 * 12 * d * d + attn) / unit, rel=1e-12)
    assert costs.loss == pytest.approx((2 * (d * d + 12 * d * d + gate + v * d) + attn) / unit, rel=1e-12)
    assert costs.embed_backward == 2 * costs.embed and costs.loss_backward == 2 * costs.loss


def test_schedule_equals_a_direct_simulation_of_the_sampled_step():
    """One data-parallel rank with depth buckets: the micro-batches are the global batch's depths (the config's
    sampler, step 0) sorted and cut into micro-batches; the planner's figures equal ring_schedule + simulate."""
    cfg, plan = _plan(["data.global_batch_size=32", "data.micro_batch_size=4", "model.mu_rec=6"], 2)
    pipe = plan.pipeline
    m = cfg.model
    depths = make_sampler(m.depth_sampler, m.mu_rec, m.backprop_depth, cfg.train.seed).sample(0, np.arange(32))
    chunks = np.sort(depths.T.numpy()).reshape(8, 4)
    assert [s.laps for s in pipe.specs] == chunks.max(axis=1).tolist()
    assert [s.grad_laps for s in pipe.specs] == np.minimum(chunks.max(axis=1), m.backprop_depth).tolist()
    first = pipe.specs[0]
    assert first.active == tuple((chunks[0] >= first.laps - lap).mean() for lap in range(first.laps))
    bound = 3 * 2
    direct = simulate(ring_schedule(pipe.specs, 2, bound, 2 * bound, pipe.costs), pipe.specs, pipe.costs)
    assert pipe.result.makespan == direct.makespan
    assert [st.idle for st in pipe.stages] == direct.idle_fractions
    assert [st.peak_units for st in pipe.stages] == direct.peak_stored
    assert pipe.interleaved_idle == pytest.approx(1 / (np.mean(chunks.max(axis=1)) * 8), rel=1e-12)


def test_lap_checkpointing_unit_is_one_state():
    """Under activation_checkpointing=lap a kept lap segment stores only its input state: b x s x d fp32 values."""
    cfg, plan = _plan(["train.activation_checkpointing=lap"], 2)
    assert {st.unit_bytes for st in plan.pipeline.stages} == {8 * cfg.model.seq_len * cfg.model.d_model * 4}


def _cli(capsys, *args):
    from megaloop.__main__ import main

    code = main(["plan", str(TINY), "--nodes", "1", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_pipeline_json_and_text(capsys):
    code, out, err = _cli(capsys, "--gpus-per-node", "4", "--pp", "2", "--set", "data.global_batch_size=32", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["layout"]["pp"] == 2 and plan["layout"]["dp"] == 2 and "settings" not in plan
    pipe = plan["pipeline"]
    assert pipe["micro_batches"] == 32 // (8 * 2) and len(pipe["stages"]) == 2
    for st in pipe["stages"]:
        parts = ("params_bytes", "grads_bytes", "muon_bytes", "adamw_bytes", "activations_bytes")
        assert st["activations_bytes"] == st["peak_stored_units"] * st["unit_bytes"]
        assert st["total_bytes"] == sum(st[k] for k in parts[:-1]) + st["stored_bytes"]
    code, out, err = _cli(capsys, "--gpus-per-node", "2", "--pp", "2")
    assert code == 0, err
    assert "tp 1 x pp 2 x dp 1" in out and "simulated makespan" in out and "interleaved 1F1B" in out


@pytest.mark.parametrize("args,needles", [
    (["--pp", "4"], ["parallel.pp=4", "the core has 2 blocks", "use parallel.pp <= 2"]),
    (["--pp", "2", "--set", "data.global_batch_size=32", "--set", "data.micro_batch_size=16"],
     ["parallel.pp=2", "gives 1", "dp=2", "data.micro_batch_size=8", "data.global_batch_size=64"]),
    (["--pp", "2", "--set", "parallel.engine=deepspeed", "--set", "optim.name=adamw"],
     ["parallel.pp=2", "use parallel.engine=native"]),
])
def test_cli_refuses_an_invalid_pp(capsys, args, needles):
    code, _, err = _cli(capsys, "--gpus-per-node", "4", *args)
    assert code == 2 and all(n in err for n in needles), err


def test_stored_bytes_replay_counts_each_unit_at_its_size():
    """GPipe on 2 ranks, 3 micro-batches: every forward before any backward, so rank 0 peaks at 3 x (Embed + a lap
    segment) and rank 1 at 3 x (a lap segment + Loss); with every size 1 the replay is the simulator's unit count."""
    from pipeline.ring import gpipe, uniform_specs

    from megaloop.plan.pipeline import peak_stored_bytes

    result = simulate(gpipe(2, 3), uniform_specs(3))
    assert peak_stored_bytes(result, [1, 2], embed=10, loss=100) == [3 * (10 + 1), 3 * (2 + 100)]
    _, plan = _plan(["data.global_batch_size=32", "data.micro_batch_size=4"], 2)
    sim = plan.pipeline.result
    assert peak_stored_bytes(sim, [1, 1], 1, 1) == sim.peak_stored


def test_in_flight_bound_is_kept():
    """--in-flight K: at most K x pp micro-batches hold lap activations on any rank."""
    cfg = load_config(TINY, ["parallel.pp=2", "data.global_batch_size=64", "data.micro_batch_size=2"], world_size=2)
    for k in (1, 2):
        pipe = make_plan(cfg, GPUS["h100"], 2, in_flight=k).pipeline
        assert pipe.max_in_flight == 2 * k and max(pipe.result.peak_in_flight) <= 2 * k
