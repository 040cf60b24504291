"""Workers of the multi-process checkpoint tests: megaloop's trainer saving and resuming under tensor and data
parallelism, and a check that a checkpoint loaded under any layout holds exactly the saved global arrays."""
from __future__ import annotations

import torch

from megaloop.config import load_config
from megaloop.train.checkpointing import RunCheckpoints, state_pieces
from megaloop.train.data import open_data
from megaloop.train.loop import build_model_and_optimizer, train
from megaloop.train.runtime import make_runtime
from pipeline.tensor_parallel import gather_full


def run(config_path: str, overrides: list[str]) -> dict:
    """One training job on this world; per-step losses and the full final parameters."""
    cfg = load_config(config_path, overrides)
    runtime = make_runtime(cfg, torch.device("cpu"))
    kept = {}
    prepare = runtime.prepare_model
    runtime.prepare_model = lambda model, **kw: kept.setdefault("model", prepare(model, **kw))
    summary = train(cfg, runtime=runtime)
    params = {n: gather_full(p.detach(), runtime.shard_spec(n), getattr(runtime, "layout", None) and
                             runtime.layout.tp_group) for n, p in kept["model"].named_parameters()}
    return {"losses": summary.losses, "params": params, "start": summary.start_step, "done": summary.steps_done,
            "interrupted": summary.interrupted}


def worker(rank: int, world: int, config_path: str, jobs: list, out_path: str) -> None:
    """jobs: [(label, overrides)] run in order on this world; rank 0 saves {label: result}."""
    results = {label: run(config_path, overrides) for label, overrides in jobs}
    if rank == 0:
        torch.save(results, out_path)


def loaded_state_worker(rank: int, world: int, config_path: str, overrides: list, out_path: str) -> None:
    """Restore a checkpoint under this world's layout (checkpoint.resume in `overrides`), then compare every piece of
    state this rank holds with the same region of the saved global array: bit for bit."""
    from checkpoints.load import CheckpointReader

    cfg = load_config(config_path, overrides)
    runtime = make_runtime(cfg, torch.device("cpu"))
    data = open_data(cfg, runtime.dp_rank, runtime.dp_size)
    model, optimizer = build_model_and_optimizer(cfg, runtime, torch.device("cpu"))
    ckpt = RunCheckpoints(cfg, runtime)
    start = ckpt.restore(model, optimizer, data)
    reader = CheckpointReader(ckpt.resumed_from)
    pieces, _ = state_pieces(model, optimizer, runtime)
    mismatched = [p.name for p in pieces
                  if not torch.equal(p.tensor, reader.read(p.name, p.offsets, tuple(p.tensor.shape)))]
    names = sorted({p.name for p in pieces})
    gathered = runtime.all_gather_object((names, mismatched, len(pieces)))
    data.close()
    if rank == 0:
        torch.save({"start": start, "names": [g[0] for g in gathered], "mismatched": [g[1] for g in gathered],
                    "pieces": [g[2] for g in gathered], "arrays": sorted(reader.arrays)}, out_path)
