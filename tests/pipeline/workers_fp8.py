"""Worker of the FP8 layout tests: megaloop's trainer with train.fp8 on several layouts in turn inside one
torch.distributed world; returns per-step losses and every FP8 layer's first-call scales and every call's scales as
one process holds them (row-wise weight scales of column-parallel layers gathered over tp, every pipeline stage's
layers merged)."""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from megaloop.config import load_config
from megaloop.train.loop import train
from pipeline.fp8 import Float8Linear, float8_layers
from pipeline.tensor_parallel import gather_full
from tests.pipeline.workers_train import traced_runtime


def held_scales(runtime) -> dict[str, torch.Tensor]:
    """'<layer>.<role>' -> first-call scale, whole (see the module docstring); merged over every rank."""
    layout = runtime.layout
    group = layout.tp_group if layout is not None and layout.tp > 1 else None
    shards = runtime.tp_info.shards if getattr(runtime, "tp_info", None) is not None else {}
    local = {}
    for name, layer in float8_layers(runtime.model).items():
        for role, scale in sorted(layer.fp8_scales.items()):
            if role == "calls":  # every call's, as a sorted multiset per role (a schedule may reorder calls)
                for r in ("x", "w", "g"):
                    mine = [s for rr, s in scale if rr == r]
                    if mine and r == "w" and layer.fp8.rowwise and layer.fp8.split == "column":  # gathered, whole
                        mine = [gather_full(s, shards.get(f"{name}.weight"), group) for s in mine]
                    if mine:
                        local[f"{name}.{r}.calls"] = sorted(tuple(s.flatten().tolist()) for s in mine)
                continue
            if scale.dim() and role == "w" and layer.fp8.split == "column":  # this rank's rows' scales
                scale = gather_full(scale, shards.get(f"{name}.weight"), group)
            local[f"{name}.{role}"] = scale
    if layout is None:
        return local
    merged = {}
    tp_rank = getattr(layout, "tp_rank", 0)
    for rank_tp, scales in runtime.all_gather_object((tp_rank, local)):
        for key, value in scales.items():
            if key.endswith(".calls"):  # every data-parallel replica's calls, once per tp group
                if rank_tp == 0:
                    merged[key] = sorted(merged.get(key, []) + value)
            else:
                merged.setdefault(key, value)
    return merged


def fp8_run(config_path: str, overrides: list[str], runtime_factory=traced_runtime) -> dict:
    Float8Linear.record_every_call = True
    cfg = load_config(config_path, overrides)
    runtime = runtime_factory(cfg, torch.device("cpu"))
    summary = train(cfg, runtime=runtime)
    return {"losses": summary.losses, "scales": held_scales(runtime)}


def layout_overrides(shards, out_dir, recipe: str, precision: str, steps: int, rounding: str = "auto") -> list[str]:
    """parcae-tiny at vocab 512, 32-token rows, 16 rows per step in micro-batches of 2, FP8 on; every layout reads
    the single process's micro-batches (no depth buckets, dp_balance=rows) and no validation batches run (their rows
    depend on dp by design), so every recorded call is a training step's."""
    return [f"data.shards={shards}", f"train.out_dir={out_dir}", f"train.steps={steps}", "model.vocab_size=512",
            "model.seq_len=32", "data.micro_batch_size=2", "data.global_batch_size=16", "data.val_batches=0",
            "train.val_every=1000", "train.progress=false", f"train.precision={precision}",
            f"train.fp8={recipe}", f"train.fp8_scale_rounding={rounding}", "train.bucket_depths=false",
            "parallel.dp_balance=rows", "checkpoint.every=0"]


def compare_runs(got: dict, ref: dict) -> dict:
    """A run's losses and scales (fp8_run) against the single process's: the worst relative loss difference, the
    first-call scales (all, and the weights') bit-identical, and every call's scale found bit-identical among the
    single process's calls of the same layer and role (a multiset: a pipeline schedule reorders calls)."""
    loss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    first = {k: v for k, v in ref["scales"].items() if not k.endswith(".calls")}
    same = [k for k, v in first.items() if k in got["scales"] and torch.equal(got["scales"][k], v)]
    weights = [k for k in first if k.endswith(".w")]
    calls = {k: v for k, v in ref["scales"].items() if k.endswith(".calls")}
    calls_equal = sum(sum((Counter(v) & Counter(got["scales"].get(k, []))).values()) for k, v in calls.items())
    return {"loss_rel": loss, "scales_equal": len(same), "scales": len(first),
            "calls_equal": calls_equal, "calls": sum(len(v) for v in calls.values()),
            "weight_scales_equal": sum(k in same for k in weights), "weight_scales": len(weights),
            "missing": sorted(set(first) - set(got["scales"]))}


def worker(rank: int, world: int, config_path: str, runs: dict, out_path: str) -> None:
    results = {label: fp8_run(config_path, overrides) for label, overrides in runs.items()}
    if rank == 0:
        torch.save(results, out_path)


def _mlp_scales(mlp, x, grad, group, shards) -> tuple[dict, torch.Tensor]:
    """First-call scales of the MLP's two FP8 layers after one forward/backward, and its output."""
    y = mlp(x)
    y.backward(grad)
    scales = {}
    for name, layer in float8_layers(mlp).items():
        for role, scale in sorted(layer.fp8_scales.items()):
            if scale.dim() and role == "w" and layer.fp8.split == "column":
                scale = gather_full(scale, shards.get(f"{name}.weight"), group)
            scales[f"{name}.{role}"] = scale
    return scales, y.detach()


def tp_scales_worker(rank: int, world: int, out_path: str) -> None:
    """An MLP (fc column-parallel, proj row-parallel; ReLU^2 and SwiGLU, whose fc is column-paired) in FP8, whole on
    every rank and split at tp=world with and without sequence parallelism, on the same input and output gradient:
    which scales of the first call are bit-identical, and the output difference. `reduce=False` drops the tp group
    from the FP8 settings (rank-local amaxes): the control that shows the comparison can fail."""
    import copy

    from megaloop.model.layers import ReluSquaredMLP, SwiGLUMLP
    from pipeline.fp8 import convert_to_float8
    from pipeline.layout import init_layout
    from pipeline.tensor_parallel import apply_tensor_parallel

    d, hidden, seq = 64, 128, 8
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, seq, d, generator=g)
    grad = torch.randn(2, seq, d, generator=g)
    results = {}
    layouts = {sp: init_layout(tp=world, sequence_parallel=sp) for sp in (False, True)}
    for mlp_cls in (ReluSquaredMLP, SwiGLUMLP):
        torch.manual_seed(0)
        base = nn.Module()
        base.mlp = mlp_cls(d, hidden)
        fc_style = "column-paired" if mlp_cls is SwiGLUMLP else "column"
        plan = (("mlp", "enter"), ("mlp.fc", fc_style), ("mlp.proj", "row"))
        for recipe in ("tensorwise", "rowwise"):
            whole = copy.deepcopy(base)
            convert_to_float8(whole, recipe, ("*",))
            want, y_want = _mlp_scales(whole.mlp, x, grad, None, {})
            for sp, reduce in ((False, True), (True, True), (False, False)):
                layout = layouts[sp]
                split = copy.deepcopy(base)
                info = apply_tensor_parallel(split, plan, layout)
                convert_to_float8(split, recipe, ("*",), layout.tp_group if reduce else None)
                cut = (lambda t: t.chunk(world, dim=1)[layout.tp_rank]) if sp else (lambda t: t)
                got, y = _mlp_scales(split.mlp, cut(x), cut(grad), layout.tp_group,
                                     {k.removeprefix("mlp."): v for k, v in info.shards.items()})
                results[mlp_cls.__name__, recipe, sp, reduce] = {
                    "n": len(want), "equal": sorted(k for k in want if k in got and torch.equal(got[k], want[k])),
                    "y_err": ((y - cut(y_want)).abs().max() / y_want.abs().max()).item()}
    if rank == 0:
        torch.save(results, out_path)


def tp2_worker(rank: int, world: int, mlp_out: str, config_path: str, runs: dict, runs_out: str) -> None:
    """tp_scales_worker, then the trainer runs of `worker`, in one world (one start-up for both tests)."""
    tp_scales_worker(rank, world, mlp_out)
    worker(rank, world, config_path, runs, runs_out)
