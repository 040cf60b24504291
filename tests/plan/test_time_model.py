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
    BEFORE,
    Cluster,
    DpComm,
    DpTraffic,
    Link,
    bucket_sizes,
    collective_time,
    dp_traffic,
    h100_cluster,
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


def test_buckets_before_and_after_at_dp_128():
    n = 1_340_000_000
    assert BEFORE.bucket_elements(128, 4) == 25 * 2**20 // 4
    assert AFTER.bucket_elements(128, 4) == 128_000_000
    assert AFTER.bucket_elements(8, 4) == 40_000_000
    assert bucket_sizes(10, 4) == [4, 4, 2] and sum(bucket_sizes(n, 6_553_600)) == n
    link = h100_cluster().group_link(128, 1)
    before = dp_traffic(n, 128, link, BEFORE, 4, 4, sharded=True)
    after = dp_traffic(n, 128, link, AFTER, 4, 4, sharded=True)
    assert before.calls == 2 * math.ceil(n / 6_553_600) and after.calls == 2 * 11
    # same bytes, more calls: the difference is the latency of the extra ring steps
    extra = (before.calls - after.calls) / 2 * 127 * 5e-6
    assert before.reduce_s - after.reduce_s == pytest.approx(extra, rel=1e-9)
    bf16 = dp_traffic(n, 128, link, AFTER, 4, 2, sharded=True)
    assert bf16.reduce_s < after.reduce_s and bf16.calls == after.calls
    assert dp_traffic(n, 1, link, AFTER, 4, 4, sharded=True).reduce_s == 0.0


def test_exposure_after_overlap():
    t = DpTraffic(reduce_s=1.0, reduce_last_s=0.1, gather_s=0.8, gather_first_s=0.05, calls=10)
    assert t.exposed(backward_window=0.5, forward_window=0.3, overlap_param_gather=False) == pytest.approx(0.5 + 0.8)
    assert t.exposed(0.5, 0.3, True) == pytest.approx(0.5 + 0.5)
    assert t.exposed(5.0, 5.0, True) == pytest.approx(0.1 + 0.05)  # hidden but the last / first bucket


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
    assert out["days"] == pytest.approx(1e9 / out["tokens_per_s"] / 86400)
    assert 0 < out["exposed_comm_fraction"] < 1 and out["peak_gib"] > 0


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
