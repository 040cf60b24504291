"""idle_fraction of data parallelism, simulated from the sampler's depths: equal rows per rank vs depth-balanced.

idle_fraction = 1 - sum of depths / (dp x the busiest rank's executed core passes), averaged over steps.
  contiguous   rank r reads the r-th contiguous share of the global batch and buckets it by depth, each micro-batch
             running its deepest depth for every row (the padded loop): the trainer before depth balancing
  rows       equal rows and micro-batch counts per rank (depth buckets dealt by assign_buckets_to_ranks), each
             micro-batch running its deepest depth for every row (the padded loop): the previous trainer
  rows+ragged  the same dealing under the ragged loop (a micro-batch runs the sum of its depths)
  depth      sequences dealt by loop work (megaloop.depth.balance.deal_by_depth) under the ragged loop
  optimum    (global batches of at most 24 rows) the least busiest-rank work of any dealing, by exhaustive search:
             what no dealing can beat
--flops CONFIG compares the dealings by FLOPs (idle_fraction = 1 - useful FLOPs / (dp x the busiest rank's FLOPs),
a row costing non_loop + n x c_ng + k x c_g per token from CONFIG's FLOP model, the ragged loop) at dp 128 / global
batch 256 and dp 8 / global batch 64 (or --dp/--global-batch):
  loop-pass idle, depth dealing   the figure logged before (deal_by_depth by depths, idle over core passes)
  FLOP idle, depth dealing        the same dealing weighted by FLOPs (before)
  FLOP idle, cost dealing         deal_by_depth by row_costs (after; the trainer's idle_fraction)
  loop-pass idle, cost dealing    the same dealing over core passes (the trainer's idle_fraction_loop)
  bound                           the least FLOP idle any dealing of whole rows could reach, from a lower bound on
                                  the busiest rank's FLOPs: max(total / dp, the costliest row, and for every k the
                                  k + 1 cheapest of the k dp + 1 costliest rows, which some rank must share)
  at bound                        the share of steps where the cost dealing meets that bound (provably optimal)
  optimum, at optimum             (global batches of at most 2 dp rows, where a rank holds few rows) the exact least
                                  FLOP idle of any dealing, by integer programs over rank configurations (scipy's
                                  HiGHS), and the share of steps where the cost dealing reaches it
Usage (from the repository root):

    python benchmarks/dp_balance.py                 # the standard cases, 200 steps each
    python benchmarks/dp_balance.py --flops configs/parcae-1_3b.yaml --steps 200
    python benchmarks/dp_balance.py --dp 8 --global-batch 64 --micro-batch 4 --steps 1000
    python benchmarks/dp_balance.py --trainer SHARD_DIR --dp 4 --global-batch 32 --micro-batch 2 --steps 10

--trainer runs configs/parcae-tiny.yaml (d_model 64) on SHARD_DIR (32-token rows, vocab <= 512) with dp processes
(gloo, CPU) once with parallel.dp_balance=rows and once with depth, and prints the idle_fraction the trainer logged
(measured from the core passes the model ran), next to the simulation of the same steps.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaloop.depth import SAMPLERS, executed_core_passes, make_sampler  # noqa: E402  (after the path set-up)
from megaloop.depth.balance import (  # noqa: E402
    deal_by_depth,
    deal_by_rows,
    idle_fraction,
    row_costs,
    split_rank_rows,
)

CASES = ((8, 64, 4), (8, 32, 4), (8, 16, 2), (64, 512, 4))  # (dp, global batch, micro-batch)
FLOP_CASES = ((128, 256), (8, 64))  # (dp, global batch)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sampler", default="poisson-truncated-full", choices=sorted(SAMPLERS))
    parser.add_argument("--mu-rec", type=int, default=8)
    parser.add_argument("--dp", type=int, default=None, help="one case (with --global-batch, --micro-batch)")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trainer", default=None, metavar="SHARD_DIR", help="measure in a dp CPU training run")
    parser.add_argument("--flops", default=None, metavar="CONFIG",
                        help="FLOP-weighted idle of the depth and cost dealings, with CONFIG's model and sampler")
    return parser.parse_args(argv)


def rank_work(depths: np.ndarray, rank_positions, micro_batch: int, padded: bool) -> list[int]:
    """Executed core passes of each rank: its rows cut into depth-sorted micro-batches, each running the sum of
    its depths (ragged) or its deepest depth for every row (padded)."""
    work = []
    for positions in rank_positions:
        mine = depths[positions]
        mbs = split_rank_rows(mine, micro_batch)
        work.append(executed_core_passes(mine, mbs) if padded else int(mine.sum()))
    return work


def _fits(depths: list[int], loads: list[int], cap: int) -> bool:
    """Can depths[0:] (decreasing) be added to `loads` with no load above cap? (depth-first, equal loads once)"""
    if not depths:
        return True
    tried = set()
    for r, load in enumerate(loads):
        if load in tried or load + depths[0] > cap:
            continue
        tried.add(load)
        loads[r] += depths[0]
        if _fits(depths[1:], loads, cap):
            return True
        loads[r] -= depths[0]
    return False


def optimal_busiest(depths: np.ndarray, dp: int) -> int:
    """The least possible busiest-rank work over all dealings of these depths to dp ranks."""
    ordered = sorted(depths.tolist(), reverse=True)
    cap = max(ordered[0], -(-sum(ordered) // dp))
    while not _fits(ordered, [0] * dp, cap):
        cap += 1
    return cap


def simulate(sampler, dp: int, batch: int, micro_batch: int, steps: int) -> dict[str, float]:
    """Mean idle_fraction over `steps` global batches for each dealing."""
    figures = {"contiguous": [], "rows": [], "rows+ragged": [], "depth": []}
    if batch <= 24:
        figures["optimum"] = []
    for step in range(steps):
        depths = sampler.sample(step, np.arange(step * batch, (step + 1) * batch)).T.numpy()
        total = int(depths.sum())
        share = batch // dp
        contiguous = [np.arange(r * share, (r + 1) * share) for r in range(dp)]
        figures["contiguous"].append(idle_fraction(total, rank_work(depths, contiguous, micro_batch, padded=True)))
        if "optimum" in figures:
            figures["optimum"].append(idle_fraction(total, [optimal_busiest(depths, dp)] * dp))
        rows = deal_by_rows(depths, dp, micro_batch)
        figures["rows"].append(idle_fraction(total, rank_work(depths, rows, micro_batch, padded=True)))
        figures["rows+ragged"].append(idle_fraction(total, rank_work(depths, rows, micro_batch, padded=False)))
        balanced = deal_by_depth(depths, dp)
        figures["depth"].append(idle_fraction(total, rank_work(depths, balanced, micro_batch, padded=False)))
    return {name: float(np.mean(values)) for name, values in figures.items()}


def busiest_lower_bound(costs: np.ndarray, dp: int) -> int:
    """No dealing of these whole rows to dp ranks has a busiest rank below this: the mean load, the costliest row,
    and for k >= 1 the k + 1 cheapest of the k dp + 1 costliest rows (by pigeonhole one rank holds k + 1 of them)."""
    ordered = np.sort(np.asarray(costs, dtype=np.int64))[::-1]
    bound = max(-(-int(ordered.sum()) // dp), int(ordered[0]))
    k = 1
    while k * dp + 1 <= ordered.size:
        bound = max(bound, int(ordered[k * dp - k:k * dp + 1].sum()))
        k += 1
    return bound


def _configurations(costs: list[int], counts: list[int], cap: int) -> list[tuple[list[int], int]]:
    """Every multiset of rows (at most counts[t] of cost costs[t]) with a total of at most cap: (counts, total)."""
    out = []

    def extend(t: int, chosen: list[int], total: int) -> None:
        if t == len(costs):
            if total:
                out.append((list(chosen), total))
            return
        for m in range(min(counts[t], (cap - total) // costs[t]) + 1):
            chosen.append(m)
            extend(t + 1, chosen, total + m * costs[t])
            chosen.pop()

    extend(0, [], 0)
    return out


def _packs(costs: list[int], counts: list[int], dp: int, cap: int) -> bool:
    """Can the rows be dealt to dp ranks with none above cap? An integer program over rank configurations: the
    fewest configurations (each a multiset of rows of total <= cap) that together hold every row, against dp."""
    from scipy.optimize import LinearConstraint, milp

    configs = _configurations(costs, counts, cap)
    if not configs:
        return False
    a = np.array([c for c, _ in configs], dtype=float).T   # [types, configurations]
    res = milp(np.ones(a.shape[1]), constraints=LinearConstraint(a, lb=np.asarray(counts, float)),
               integrality=np.ones(a.shape[1]), bounds=(0, dp))
    return res.status == 0 and res.fun <= dp + 1e-9


def optimal_busiest_costs(costs: np.ndarray, dp: int, upper: int) -> int:
    """The least busiest-rank cost over every dealing of these rows (rows of equal cost are alike, so the search is
    over how many rows of each cost a rank holds): a binary search between busiest_lower_bound and `upper` (a
    dealing's busiest rank) over the totals a rank can have, each probe one integer program (scipy's HiGHS)."""
    values, counts = np.unique(np.asarray(costs, dtype=np.int64), return_counts=True)
    values, counts = values[::-1].tolist(), counts[::-1].tolist()
    low = busiest_lower_bound(costs, dp)
    candidates = sorted({total for _, total in _configurations(values, counts, upper) if low <= total < upper})
    best = upper
    lo, hi = 0, len(candidates) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if _packs(values, counts, dp, candidates[mid]):
            best, hi = candidates[mid], mid - 1
        else:
            lo = mid + 1
    return best


def flop_balance(model, dp: int, batch: int, steps: int, seed: int, exact: bool = False) -> dict[str, float]:
    """Mean idle fractions over `steps` global batches (see the module docstring, --flops)."""
    from megaloop.train.flops import FlopModel

    sampler = make_sampler(model.depth_sampler, model.mu_rec, model.backprop_depth, seed=seed)
    coefficients = FlopModel.of(model).integer_coefficients()
    figures = {"loop-pass idle, depth dealing": [], "FLOP idle, depth dealing": [], "FLOP idle, cost dealing": [],
               "loop-pass idle, cost dealing": [], "bound": [], "at bound": []}
    if exact:
        figures.update({"optimum": [], "at optimum": []})
    for step in range(steps):
        sample = sampler.sample(step, np.arange(step * batch, (step + 1) * batch))
        depths = sample.T.numpy()
        costs = row_costs(sample.n.numpy(), sample.k.numpy(), *coefficients)
        total_depth, total_cost = int(depths.sum()), int(costs.sum())
        old, new = deal_by_depth(depths, dp), deal_by_depth(depths, dp, costs)
        busiest = max(int(costs[r].sum()) for r in new)
        bound = busiest_lower_bound(costs, dp)
        figures["loop-pass idle, depth dealing"].append(idle_fraction(total_depth, [depths[r].sum() for r in old]))
        figures["FLOP idle, depth dealing"].append(idle_fraction(total_cost, [costs[r].sum() for r in old]))
        figures["FLOP idle, cost dealing"].append(idle_fraction(total_cost, [busiest] * dp))
        figures["loop-pass idle, cost dealing"].append(idle_fraction(total_depth, [depths[r].sum() for r in new]))
        figures["bound"].append(idle_fraction(total_cost, [bound] * dp))
        figures["at bound"].append(float(busiest == bound))
        if exact:
            best = optimal_busiest_costs(costs, dp, busiest)
            figures["optimum"].append(idle_fraction(total_cost, [best] * dp))
            figures["at optimum"].append(float(busiest == best))
    return {name: float(np.mean(values)) for name, values in figures.items()}


def _trainer_rank(rank: int, world: int, port: int, overrides: list[str]) -> None:
    import os

    import torch

    from megaloop.config import load_config
    from megaloop.train.loop import train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        train(load_config(Path(__file__).resolve().parents[1] / "configs" / "parcae-tiny.yaml", overrides))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def measure_trainer(args) -> dict[str, float]:
    """Mean logged idle_fraction of a dp training run per dealing (rows, depth)."""
    import json
    import socket
    import tempfile

    import torch.multiprocessing as mp

    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("rows", "depth"):
            out = Path(tmp) / mode
            overrides = [f"data.shards={args.trainer}", f"train.out_dir={out}", f"train.steps={args.steps}",
                         "model.vocab_size=512", "model.d_model=64", "model.n_heads=2", "model.ve_gate_channels=16",
                         "model.seq_len=32", f"model.mu_rec={args.mu_rec}", f"model.depth_sampler={args.sampler}",
                         f"data.micro_batch_size={args.micro_batch}", f"data.global_batch_size={args.global_batch}",
                         "data.val_batches=0", "train.val_every=100000", "train.progress=false",
                         f"train.seed={args.seed}", f"parallel.dp={args.dp}", f"parallel.dp_balance={mode}"]
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            mp.spawn(_trainer_rank, args=(args.dp, port, overrides), nprocs=args.dp, join=True)
            records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            figures[mode] = float(np.mean([r["idle_fraction"] for r in records if r["kind"] == "train"]))
    return figures


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.flops:
        from megaloop.config import load_config

        model = load_config(args.flops).model
        cases = [(args.dp, args.global_batch)] if args.dp else FLOP_CASES
        print(f"{Path(args.flops).name}: sampler {model.depth_sampler}, mu_rec {model.mu_rec}, mu_bwd "
              f"{model.backprop_depth}, {args.steps} steps; mean per step")
        results = {}
        for dp, batch in cases:
            results[dp, batch] = res = flop_balance(model, dp, batch, args.steps, args.seed, exact=batch <= 2 * dp)
            print(f"dp {dp:3d}, {batch:4d} rows: " + "  ".join(f"{k} {v:.3f}" for k, v in res.items()), flush=True)
        return results
    if args.trainer:
        dp = args.dp or 4
        args.dp = dp
        measured = measure_trainer(args)
        simulated = simulate(make_sampler(args.sampler, args.mu_rec, seed=args.seed), dp, args.global_batch,
                             args.micro_batch, args.steps)
        print(f"trainer, dp {dp}, {args.global_batch} rows, micro-batch {args.micro_batch}, {args.steps} steps: "
              f"logged idle_fraction rows {measured['rows']:.3f} depth-balanced {measured['depth']:.3f} "
              f"(simulated: rows+ragged {simulated['rows+ragged']:.3f}, depth {simulated['depth']:.3f})")
        return {"measured": measured, "simulated": simulated}
    sampler = make_sampler(args.sampler, args.mu_rec, seed=args.seed)
    cases = [(args.dp, args.global_batch, args.micro_batch)] if args.dp else CASES
    results = {}
    print(f"sampler {args.sampler}, mu_rec {args.mu_rec}, {args.steps} steps; mean idle_fraction per step")
    for dp, batch, micro_batch in cases:
        res = simulate(sampler, dp, batch, micro_batch, args.steps)
        results[dp, batch, micro_batch] = res
        print(f"dp {dp:3d}, {batch:4d} rows, micro-batch {micro_batch}: " + "  ".join(
            f"{name} {value:.3f}" for name, value in res.items()), flush=True)
    return results


if __name__ == "__main__":
    main()
