"""Training steps under tensor x data and pipeline x data parallelism, each against the same steps in one process,
and a data-parallel checkpoint saved, resumed and compared bit for bit. Every run is megaloop's own trainer
(`train(cfg, runtime)`) on a small Parcae (d 64, 2 core blocks, seq 32) over the preflight's shards; runs are
compared through what they leave behind: the per-step losses and the final checkpoint's global arrays, which do not
depend on the layout (checkpoints.load.CheckpointReader)."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from megaloop.preflight.bandwidth import bus_bandwidth, expected_rate
from megaloop.preflight.context import Context
from megaloop.preflight.report import PathResult

STEPS = 2  # the second step runs on optimizer state (momenta, moments) the first one made
MICRO = 2
MODEL = ["model.arch=parcae", "model.vocab_size=512", "model.d_model=64", "model.n_heads=2", "model.n_prelude=1",
         "model.n_core=2", "model.n_coda=1", "model.seq_len=32", "model.mu_rec=2", "model.mu_bwd=1",
         "model.ve_gate_channels=16"]


def overrides(ctx: Context, out_dir: Path, tp: int = 1, pp: int = 1, steps: int = STEPS, extra=()) -> list[str]:
    """The run: MICRO-row micro-batches, 2 x pp of them per data-parallel rank and step; one validation batch."""
    dp = ctx.world // (tp * pp)
    return [f"data.shards={ctx.shards}", f"train.out_dir={out_dir}", f"train.steps={steps}", *MODEL,
            f"data.micro_batch_size={MICRO}", f"data.global_batch_size={MICRO * 2 * pp * dp}", "data.val_batches=1",
            "train.val_every=1000", "train.progress=false", f"train.precision={ctx.precision}",
            f"parallel.tp={tp}", f"parallel.pp={pp}", "parallel.zero_stage=1", *extra]


def run_parallel(ctx: Context, args: list[str]):
    """train() on every rank with the trainer's runtime for this world; (summary, runtime) (the runtime stays open:
    its groups are freed with the world's at the end of the preflight)."""
    from megaloop.config import load_config
    from megaloop.train.loop import train
    from megaloop.train.runtime import make_runtime

    cfg = load_config(None, args, world_size=ctx.world)
    runtime = make_runtime(cfg, ctx.device)
    return train(cfg, runtime=runtime), runtime


def run_single(ctx: Context, args: list[str]):
    """train() in this process alone (the single-process runtime), as `python -m megaloop train` runs it."""
    from megaloop.config import load_config
    from megaloop.train.loop import train
    from megaloop.train.runtime import SingleProcessRuntime

    single = [a for a in args if not a.startswith("parallel.")]
    return train(load_config(None, single), runtime=SingleProcessRuntime(ctx.device))


def final_arrays(out_dir: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every global array (named `prefix`...) of the run's newest committed checkpoint."""
    from checkpoints.load import CheckpointReader, find_checkpoints

    reader = CheckpointReader(find_checkpoints(Path(out_dir) / "checkpoints")[0])
    return {name: reader.read(name) for name in reader.arrays if name.startswith(prefix)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def compare_runs(got_losses, ref_losses, got_dir: Path, ref_dir: Path, loss_tol: float, param_tol: float,
                 bitwise: bool = False, prefix: str = "") -> tuple[bool, str]:
    """Losses and the final checkpoint arrays (those named `prefix`...) of two runs; bitwise: every array and loss
    identical."""
    got, ref = final_arrays(got_dir, prefix), final_arrays(ref_dir, prefix)
    if set(got) != set(ref) or len(got_losses) != len(ref_losses):
        return False, (f"the runs differ in shape: {len(got_losses)} against {len(ref_losses)} losses, arrays "
                       f"{sorted(set(got) ^ set(ref))[:3]} in one only")
    if bitwise:
        same = [n for n in ref if torch.equal(got[n], ref[n])]
        equal_losses = sum(a == b for a, b in zip(got_losses, ref_losses))
        ok = len(same) == len(ref) and equal_losses == len(ref_losses)
        return ok, f"{len(same)}/{len(ref)} checkpoint arrays and {equal_losses}/{len(ref_losses)} losses bit-identical"
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(got_losses, ref_losses))
    worst = max(ref, key=lambda n: rel_err(got[n], ref[n]))
    param_err = rel_err(got[worst], ref[worst])
    ok = loss_err <= loss_tol and param_err <= param_tol
    return ok, (f"{len(ref_losses)} steps, loss rel err {loss_err:.1e} (tol {loss_tol:.0e}), worst of {len(ref)} "
                f"checkpoint arrays {param_err:.1e} (tol {param_tol:.0e}, {worst})")


def _against_single(ctx: Context, name: str, tp: int, pp: int, bw_kind: str, bw_group: str) -> PathResult:
    start = time.perf_counter()
    root = ctx.work_dir / name
    extra = ["optim.matrix_lr=0.0201"] if ctx.faulty(name) else []
    summary, runtime = run_parallel(ctx, overrides(ctx, root / "parallel", tp, pp, extra=extra))
    verdict = [None, None]
    if ctx.is_main:
        ref = run_single(ctx, overrides(ctx, root / "single", tp, pp))
        verdict = list(compare_runs(summary.losses, ref.losses, root / "parallel", root / "single", ctx.loss_tol,
                                    ctx.param_tol, prefix=ctx.compared_arrays))
    layout = runtime.layout
    group, ranks = getattr(layout, f"{bw_group}_group"), getattr(layout, f"{bw_group}_ranks")
    ok, detail = agree(verdict)
    bw = bus_bandwidth(bw_kind, group, numel(ctx), ctx.device) if group is not None else None
    expected, link = expected_rate(ctx.device, ctx.spans_nodes(ranks))
    return PathResult(name, ok, f"{detail}; {bw_kind} over the {bw_group} group {list(ranks)}",
                      time.perf_counter() - start, bw, expected, link)


def agree(verdict: list) -> tuple[bool, str]:
    """Rank 0's (ok, detail) on every rank."""
    import torch.distributed as dist

    dist.broadcast_object_list(verdict, src=0)
    return bool(verdict[0]), str(verdict[1])


def numel(ctx: Context) -> int:
    """Bandwidth buffers: 64 MiB of fp32 on GPU (large enough for NCCL's peak), 1 MiB on CPU (CI time)."""
    return (16 << 20) if ctx.on_gpu else (256 << 10)


def tp2_dp(ctx: Context) -> PathResult:
    """tp2 x dp (world / 2): the tensor-parallel all-reduces and the data-parallel ZeRO-1 reduction of a step."""
    return _against_single(ctx, "tp2_dp", 2, 1, "all_reduce", "tp")


def pp2_dp(ctx: Context) -> PathResult:
    """pp2 x dp (world / 2): the ring pipeline's point-to-point messages and the gradient reduction."""
    return _against_single(ctx, "pp2_dp", 1, 2, "all_reduce", "dp")
