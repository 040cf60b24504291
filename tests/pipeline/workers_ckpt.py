"""Workers of the multi-process checkpoint tests: megaloop's trainer saving and resuming under tensor, data and
pipeline parallelism, and a check that a checkpoint loaded under any layout holds exactly the saved global arrays.
The functions also run in one process (world 1, no torch.distributed: the single-process runtime)."""
from __future__ import annotations

import torch

from megaloop.config import load_config
from megaloop.train.checkpointing import RunCheckpoints, state_pieces
from megaloop.train.data import open_data
from megaloop.train.loop import build_model_and_optimizer, train
from megaloop.train.runtime import make_runtime


def gathered_state(runtime, model, optimizer, prefix: str = "") -> tuple[dict, list]:
    """Every checkpoint array whose name starts with `prefix` as one whole tensor, assembled from every rank's
    pieces (state_pieces: parameters and optimizer state, tp shards, pipeline stages), on every rank; and the names
    of arrays that some rank's region leaves uncovered or whose replicas (the same region on several ranks:
    data-parallel copies, the tied embedding on the first and last stage) differ."""
    pieces, _ = state_pieces(model, optimizer, runtime)
    mine = [(p.name, tuple(p.global_shape), tuple(p.offsets), p.tensor.detach().cpu().clone())
            for p in pieces if p.name.startswith(prefix)]
    arrays, filled, bad = {}, {}, set()
    for held in runtime.all_gather_object(mine):
        for name, shape, offsets, tensor in held:
            whole = arrays.setdefault(name, torch.zeros(shape, dtype=tensor.dtype))
            done = filled.setdefault(name, torch.zeros(shape, dtype=torch.bool))
            region = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))
            if done[region].any() and not torch.equal(whole[region], tensor):
                bad.add(name)
            whole[region], done[region] = tensor, True
    bad |= {name for name, done in filled.items() if not done.all()}
    return arrays, sorted(bad)


def run(config_path: str, overrides: list[str], with_state: bool = False) -> dict:
    """One training job on this world: per-step losses and the full final parameters (every stage's, tp pieces
    gathered); with_state: also every array a checkpoint of the final state holds (gathered_state)."""
    cfg = load_config(config_path, overrides)
    runtime = make_runtime(cfg, torch.device("cpu"))
    kept = {}
    prepare, prepare_optimizer = runtime.prepare_model, runtime.prepare_optimizer
    runtime.prepare_model = lambda model, **kw: kept.setdefault("model", prepare(model, **kw))
    runtime.prepare_optimizer = lambda opt: kept.setdefault("optimizer", prepare_optimizer(opt))
    summary = train(cfg, runtime=runtime)
    state, bad = gathered_state(runtime, kept["model"], kept["optimizer"], "" if with_state else "model/")
    result = {"losses": summary.losses, "params": {n.removeprefix("model/"): t for n, t in state.items()
                                                   if n.startswith("model/")},
              "start": summary.start_step, "done": summary.steps_done, "interrupted": summary.interrupted,
              "inconsistent": bad}
    return result | ({"state": state} if with_state else {})


def worker(rank: int, world: int, config_path: str, jobs: list, out_path: str) -> None:
    """jobs: [(label, overrides)] or [(label, overrides, with_state)] run in order on this world; rank 0 saves
    {label: result}."""
    results = {job[0]: run(config_path, *job[1:]) for job in jobs}
    if rank == 0:
        torch.save(results, out_path)


def loaded_state(config_path: str, overrides: list) -> dict:
    """Restore a checkpoint under this world's layout (checkpoint.resume in `overrides`), then compare every piece of
    state this rank holds with the same region of the saved global array (bit for bit), and gather the state."""
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
    state, bad = gathered_state(runtime, model, optimizer)
    data.close()
    return {"start": start, "names": [g[0] for g in gathered], "mismatched": [g[1] for g in gathered],
            "pieces": [g[2] for g in gathered], "arrays": sorted(reader.arrays), "state": state,
            "inconsistent": bad}


def resume_worker(rank: int, world: int, config_path: str, checks: list, jobs: list, out_path: str) -> None:
    """checks: [(label, overrides)] restored and compared (loaded_state), then jobs (see worker), on this world;
    rank 0 saves {label: result} of both."""
    results = {label: loaded_state(config_path, overrides) for label, overrides in checks}
    results |= {job[0]: run(config_path, *job[1:]) for job in jobs}
    if rank == 0:
        torch.save(results, out_path)
