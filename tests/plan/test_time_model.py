"""The time planner: ring collectives against hand-computed values, link choice, buckets and overlap, the FLOP
model in seconds, the JSON keys, --search keeping to memory, and the CLI's errors."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megaloop.__main__ import main
from megaloop.config import load_config
from megaloop.plan.comm import (
    AFTER,
    Cluster,
    DpComm,
    Link,
    collective_time,
    gather_exposed,
    h100_cluster,
    reduce_exposed,
    wire_bytes,
)
from megaloop.plan.gpus import CONTEXT_BYTES, FRAGMENTATION, Gpu
from megaloop.plan.search import JSON_KEYS, Planner, search
from megaloop.plan.time_model import Device, optimizer_seconds
from megaloop.train.flops import FlopModel

TINY = Path(__file__).resolve().parents[2] / "configs" / "parcae-tiny.yaml"
FIXED = ["model.depth_sampler=fixed", "train.precision=fp32"]


def test_ring_collectives_match_hand_computed_values():
    link = Link(bandwidth=100e9, latency=2e-6)
    size = 8e6  # bytes
    assert wire_bytes("all_reduce", 4, size) == pytest.approx(2 * 3 / 4 * size)
    assert wire_bytes("reduce_scatter", 4, size) == pytest.approx(3 / 4 * size)
    assert wire_bytes("all_gather", 8, size) == pytest.approx(7 / 8 * size)
    # 2 (n - 1) steps of (latency + size / n / bandwidth): 6 x (2 us + 20 us)
    assert collective_time("all_reduce", 4, size, link) == pytest.approx(6 * (2e-6 + 2e-5))
    assert collective_time("reduce_scatter", 4, size, link, calls=3) == pytest.approx(3 * 3 * (2e-6 + 2e-5))
    assert collective_time("all_gather", 1, size, link) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time("broadcast", 4, size, link)


def test_a_link_fitted_per_collective_kind_prices_each_kind_on_its_own():
    # gloo on a CPU: the reduce-scatter is slower than a ring's; the other kinds keep the link's own figures
    link = Link(100e9, 2e-6, kinds=(("reduce_scatter", 25e9, 5e-6),))
    size = 8e6
    assert collective_time("reduce_scatter", 4, size, link) == pytest.approx(3 * (5e-6 + 2e6 / 25e9))
    assert collective_time("all_gather", 4, size, link) == pytest.approx(3 * (2e-6 + 2e-5))
    assert collective_time("all_reduce", 4, size, link) == pytest.approx(6 * (2e-6 + 2e-5))
    with pytest.raises(ValueError, match="unknown collective"):
        Link(1e9, 0.0, kinds=(("broadcast", 1e9, 0.0),))
    with pytest.raises(ValueError, match="bandwidth > 0"):
        Link(1e9, 0.0, kinds=(("all_gather", 0.0, 0.0),))


def test_tp_muon_pays_the_gather_and_scatter_of_each_split_matrix():
    cfg = load_config(TINY, FIXED + ["parallel.tp=2"], world_size=2)
    plan = _planner(2).estimate(cfg).plan

    muon = [p for p in plan.params if p.optimizer == "muon" and len(p.full_shape) == 2]
    split = [p for p in muon if p.local_shape != p.full_shape]
    assert split, "the tiny model has tp-split Muon matrices"
    link = Link(10e9, 10e-6)
    # per split matrix: a gather and a scatter, each priced as a 2-rank all-gather of its fp32 gradient
    comm = sum(2 * (10e-6 + p.full_numel * 4 / 2 / 10e9) for p in split)
    assert optimizer_seconds(list(plan.params), plan, 1e12, link) == pytest.approx(
        optimizer_seconds(list(plan.params), plan, 1e12) + comm, rel=1e-12)


def test_groups_run_over_the_link_their_ranks_span():
    c = h100_cluster()  # 8 GPUs per node, NVLink 450 GB/s 1 us, one 50 GB/s 5 us NIC per GPU
    assert c.group_link(8, 1) == c.intra  # tp 8: one node
    assert c.group_link(4, 2) == c.intra  # dp 4 at stride tp 2: one node
    every_gpu = c.group_link(128, 1)  # dp 128 at tp 1: 8 ranks per node share 8 NICs, NVLink caps it
    assert every_gpu.bandwidth == pytest.approx(400e9) and every_gpu.latency == pytest.approx(5e-6)
    one_per_node = c.group_link(16, 8)  # dp 16 at tp 8: one rank per node, one NIC
    assert one_per_node.bandwidth == pytest.approx(50e9)
    assert c.group_link(32, 2).bandwidth == pytest.approx(200e9)  # dp 32 at tp 2: 4 ranks per node


def test_reduction_and_gather_exposure_by_hand():
    # three 1 s buckets ready at 0.2, 0.5 and 1.0 of a 2 s backward: 0.4-1.4, 1.4-2.4, 2.4-3.4 -> 1.4 s past the end
    assert reduce_exposed([1.0, 1.0, 1.0], [0.2, 0.5, 1.0], 2.0) == pytest.approx(1.4)
    assert reduce_exposed([1.0, 1.0], [1.0, 1.0], 2.0) == pytest.approx(2.0)  # nothing ready early: all exposed
    # gather, one in flight, needed at 0, 0.5 and 0.9 of a 2 s forward: waits 1 s at the start, then bucket 1
    # (launched at 1, here at 2) is in time, bucket 2 (launched at 2, here at 3) is 0.2 s late at 2.8
    assert gather_exposed([1.0, 1.0, 1.0], [0.0, 0.5, 0.9], 2.0, in_flight=1) == pytest.approx(1.2)
    # two in flight: bucket 1 goes on the wire at once, bucket 2 after the wait for bucket 0 -> arrives at 3
    assert gather_exposed([1.0, 1.0, 1.0], [0.0, 0.5, 0.9], 2.0, in_flight=2) == pytest.approx(1.2)


def test_planned_buckets_are_the_buckets_the_trainer_builds():
    """The planner's buckets come from the gradient buffer the runtime lays out: same groups, padding, column
    ranges and members (parcae-tiny, ZeRO-1 at dp 4: Muon matrices whole in their owners' chunks)."""
    from megaloop.model import build_model
    from megaloop.plan.dp_buckets import planned_buckets
    from megaloop.plan.layout import local_params
    from pipeline.data_parallel import make_buckets
    from pipeline.dist_muon import assign_owners
    from pipeline.grad_buffer import GradBuffer, gradient_order

    cfg = load_config(TINY, FIXED)
    dp, elements = 4, 100_000
    model = build_model(cfg.model)
    params = local_params(cfg, 1)
    muon = [p.name for p in params if p.optimizer == "muon"]
    sizes = dict(model.named_parameters())
    owners = dict(zip(muon, assign_owners([sizes[n].numel() for n in muon], dp)))
    named, late = gradient_order(model, list(model.named_parameters()))
    buffer = GradBuffer(named, dp, 0, owners, late)
    built = [((b.hi - b.lo) * b.group.dp, b.group.late) for b in make_buckets(buffer, elements)]
    planned = planned_buckets(params, dp, 1, True, elements, "backward", cfg.model.mu_rec, cfg.model.backprop_depth)
    print(f"{len(built)} buckets, {sum(n for n, _ in built):,} elements; lookups' buckets: "
          f"{sum(late for _, late in built)}")
    assert [(b.elements, b.late) for b in planned] == built
    assert sum(late for _, late in built) >= 1 and sum(not late for _, late in built) >= 2
    main = [b for b in planned if not b.late]
    assert all(b.ready == 1.0 for b in planned if b.late)
    # the first prelude block's columns are final with the lookups; the rest of the main group earlier, and
    # the first columns (the coda's) first
    early = sum(b.elements for b in main if b.ready < 1.0)
    assert early >= 0.8 * sum(b.elements for b in main) and main[0].ready == min(b.ready for b in main)
    assert all(b.need == 0.0 for b in planned if b.late)  # the lookups are read first in the forward


def test_columns_buckets_wait_for_the_embeddings_and_backward_ones_do_not():
    """parcae-1_3b on 16 x 8 H100 (dp 128, ZeRO-1): with the earlier layout every bucket holds embedding columns,
    so the whole reduction runs after the backward; in backward order only the lookups' buckets do."""
    overrides = ["data.micro_batch_size=2", "train.precision=bf16"]
    config = Path(__file__).resolve().parents[2] / "configs" / "parcae-1_3b.yaml"
    cluster, device = h100_cluster(), Device("h100", 989.0, 0.4)
    times = {}
    for order in ("columns", "backward"):
        cfg = load_config(config, [*overrides, f"parallel.grad_buckets={order}"], world_size=128)
        times[order] = Planner(Gpu("h100", 80 * 2**30), 128, device, cluster, AFTER, None).estimate(cfg).time.dp
        t = times[order]
        print(f"{order}: reduction {t.reduce_s * 1e3:.1f} ms ({t.reduce_exposed_s * 1e3:.1f} exposed), all-gather "
              f"{t.gather_s * 1e3:.1f} ms ({t.gather_exposed_s * 1e3:.1f} exposed), {t.calls} calls")
    assert times["columns"].reduce_exposed_s == pytest.approx(times["columns"].reduce_s)
    assert times["backward"].reduce_exposed_s < 0.999 * times["backward"].reduce_s
    assert times["backward"].exposed_s < times["columns"].exposed_s


def test_bf16_reduction_is_priced_as_an_all_to_all():
    link = Link(10e9, 1e-6, kinds=(("all_to_all", 5e9, 1e-6),))
    assert collective_time("all_to_all", 4, 8e6, link) == pytest.approx(3 * (1e-6 + 2e6 / 5e9))
    assert collective_time("reduce_scatter", 4, 8e6, link) == pytest.approx(3 * (1e-6 + 2e6 / 10e9))


def _planner(world: int, gpu_bytes: int = 2**40, comm: DpComm = AFTER) -> Planner:
    link = Link(10e9, 10e-6)
    return Planner(Gpu("test", gpu_bytes), world, Device("test", 1.0, 0.5), Cluster(world, link, link), comm, None)


def test_compute_is_the_flop_model_at_the_stated_rate():
    cfg = load_config(TINY, FIXED, world_size=1)
    t = _planner(1).estimate(cfg).time
    m, fm = cfg.model, FlopModel.of(cfg.model)
    tokens = cfg.data.global_batch_size * m.seq_len
    per_token = fm.per_token(m.mu_rec - m.backprop_depth, m.backprop_depth)  # every row at mu_rec
    assert t.compute_s == pytest.approx(tokens * per_token / 0.5e12, rel=1e-12)
    assert t.tp_s == t.pp_s == t.dp_exposed_s == 0.0
    assert t.step_time_s == pytest.approx(t.compute_s + t.optimizer_s)
    block = load_config(TINY, FIXED + ["train.activation_checkpointing=block"], world_size=1)
    recompute = tokens * m.backprop_depth * fm.step_nograd / 0.5e12  # the kept laps' forward, once more
    assert _planner(1).estimate(block).time.compute_s == pytest.approx(t.compute_s + recompute, rel=1e-12)


def test_fp8_runs_its_share_of_the_flops_at_the_fp8_peak():
    """train.fp8: the core's FP8 GEMMs (their share of a lap's FLOPs, from the layer shapes) at the FP8 peak, the
    rest at the compute dtype's; the prelude and coda too with train.fp8_prelude_coda."""
    from megaloop.plan.comm import Cluster as C
    from megaloop.train.flops import fp8_shares

    link = Link(10e9, 10e-6)
    fp8_planner = Planner(Gpu("test", 2**40), 1, Device("test", 1.0, 0.5, fp8_tflops=2.0), C(1, link, link), AFTER,
                          None)
    for extra in ([], ["train.fp8_prelude_coda=true"]):
        cfg = load_config(TINY, FIXED + ["train.fp8=tensorwise"] + extra, world_size=1)
        m, fm = cfg.model, FlopModel.of(cfg.model)
        lap, ends = fp8_shares(m, prelude_coda=bool(extra))
        d, f = m.d_model, m.ffn_hidden
        assert lap == pytest.approx(2 * m.n_core * (4 * d * d + 2 * d * f) / fm.step_nograd, rel=1e-12)
        assert (ends > 0) == bool(extra)
        tokens = cfg.data.global_batch_size * m.seq_len
        laps = (m.mu_rec - m.backprop_depth) * fm.step_nograd + m.backprop_depth * fm.step_grad
        want = tokens * (fm.non_loop * (1 - ends / 2) + laps * (1 - lap / 2)) / 0.5e12  # FP8 at twice the rate
        assert fp8_planner.estimate(cfg).time.compute_s == pytest.approx(want, rel=1e-12)
    off = load_config(TINY, FIXED, world_size=1)
    assert fp8_planner.estimate(off).time.compute_s == pytest.approx(_planner(1).estimate(off).time.compute_s)


def test_plan_json_has_the_time_keys(capsys):
    assert main(["plan", str(TINY), "--nodes", "1", "--gpus-per-node", "2", "--set", "parallel.tp=2",
                 "--tokens", "1e9", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(JSON_KEYS) <= set(out)
    assert out["layout"]["tp"] == 2 and out["layout"]["gpus"] == 2 and out["layout"]["micro_batch"] == 8
    assert out["time"]["tp_exposed_s"] > 0
    steps = math.ceil(1e9 / (16 * 128))  # --tokens in whole steps of global batch x seq_len
    assert out["run"]["steps"] == steps and out["run"]["source"] == "--tokens 1e+09"
    assert out["days"] == pytest.approx(steps * out["step_time_s"] / 86400, rel=1e-12)
    assert out["gpu_hours"] == pytest.approx(steps * out["step_time_s"] * 2 / 3600, rel=1e-12)
    assert 0 < out["exposed_comm_fraction"] < 1 and out["peak_gib"] > 0


def test_plan_prices_the_configs_whole_run(capsys):
    """Without --tokens the plan prices the config's run: parcae-1_3b's 104B tokens = 198,365 steps on 128 GPUs."""
    argv = ["plan", str(TINY.parent / "parcae-1_3b.yaml"), "--nodes", "16", "--gpus-per-node", "8"]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run"] == {"tokens": 198_365 * 524_288, "steps": 198_365, "source": "train.tokens=104B",
                          "days": pytest.approx(198_365 * out["step_time_s"] / 86400, rel=1e-12),
                          "gpu_hours": pytest.approx(198_365 * out["step_time_s"] * 128 / 3600, rel=1e-12)}
    assert main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "the run:" in x)
    assert line == (f"  the run: 104B tokens = 198,365 steps (train.tokens=104B): {out['days']:.2f} days on 128 x "
                    f"H100 = {out['gpu_hours']:,.0f} GPU-hours")


def test_search_ranks_only_layouts_that_fit():
    everything = search(TINY, FIXED, _planner(2), gpus_per_node=2)
    assert {e.plan.cfg.train.activation_checkpointing for e in everything} == {"none"}
    assert {(e.plan.layout.tp, e.plan.layout.pp) for e in everything} == {(1, 1), (2, 1), (1, 2)}
    peaks = sorted({e.peak_bytes for e in everything})
    limit = peaks[len(peaks) // 2]
    gpu_bytes = int((limit + CONTEXT_BYTES) / (1 - FRAGMENTATION)) + 2  # usable: about `limit`
    ranked = search(TINY, FIXED, _planner(2, gpu_bytes), gpus_per_node=2)
    usable = Gpu("x", gpu_bytes).usable_bytes
    assert ranked and all(e.peak_bytes <= usable for e in ranked)
    assert len(ranked) < len(everything) or any(e.plan.cfg.train.activation_checkpointing != "none" for e in ranked)
    times = [e.time.step_time_s for e in ranked]
    assert times == sorted(times)


@pytest.mark.parametrize("flag,value,message", [("--mfu", "1.5", "--mfu"), ("--mfu", "0", "--mfu"),
                                                ("--tokens", "-1", "--tokens"),
                                                ("--inter-gbps", "0", "--inter-gbps"),
                                                ("--intra-latency-us", "-1", "--intra-latency-us")])
def test_bad_time_flags_are_one_line_errors(capsys, flag, value, message):
    assert main(["plan", str(TINY), "--nodes", "1", "--gpus-per-node", "1", flag, value]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_peak_is_needed_for_a_precision_the_table_lacks(capsys):
    assert main(["plan", str(TINY), "--nodes", "1", "--gpus-per-node", "1", "--set", "train.precision=fp64"]) == 2
    assert "--peak-tflops" in capsys.readouterr().err
    assert main(["plan", str(TINY), "--nodes", "1", "--gpus-per-node", "1", "--set", "train.precision=fp64",
                 "--peak-tflops", "60"]) == 0
    assert main(["plan", str(TINY), "--nodes", "1", "--gpus-per-node", "1", "--set", "train.precision=fp32"]) == 0
    assert "dense peak 66.9 TFLOP/s" in capsys.readouterr().out  # fp32 is in the table (non-tensor-core rate)
    assert main(["plan", str(TINY), "--nodes", "1", "--gpus-per-node", "1", "--gpu", "a100",
                 "--set", "train.fp8=tensorwise"]) == 2
    assert "train.fp8" in capsys.readouterr().err
