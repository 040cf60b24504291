"""Answer accuracy and loss on a synthetic reasoning dataset (`python -m data_prep synth`), per difficulty and per
loop depth T: `megaloop eval RUN --tasks synth`, or `evaluate_synth` / `evaluate_checkpoint` from Python.

Each held-out row is scored by one teacher-forced forward at a fixed T with the fixed evaluation h_0 of
megaloop.eval.scoring.Scorer; the answer at position p (recorded beside the shards) is predicted from the logits at
p - 1. Per query: correct = the argmax of those logits is the answer (greedy), loss = -log p(answer). Per (T, hops):
their means over the queries of that difficulty, each with a 95% percentile-bootstrap interval over queries
(megaloop.eval.depth_eval.bootstrap_ratio, seeded with the eval seed), and n, the number of queries.

The table, `{"task", "rows", "queries", "by_depth": {T: {hops: {"acc", "acc_lo", "acc_hi", "loss", "loss_lo",
"loss_hi", "n"}}}}`, is what `--json` prints under "synth"; megaloop.laws.difficulty turns it into test-time law
points per difficulty.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from megaloop.eval.errors import EvalInputError
from megaloop.eval.world import World


@dataclass
class SynthSet:
    """Held-out rows of a synth dataset: tokens [R, seq_len + 1] and queries [Q, 3] (row, position, hops), sorted
    by row."""

    task: str
    tokens: torch.Tensor
    queries: np.ndarray
    vocab_size: int  # the dataset's tokenizer's


def read_synth(shards, limit: int | None = None) -> SynthSet:
    """The val split of the synth dataset in `shards` (its first `limit` rows and their queries)."""
    from data_prep.errors import DataPrepError
    from data_prep.shard_reader import ShardDataset
    from data_prep.synth import read_queries

    if shards is None:
        raise EvalInputError("--tasks synth: the run records no data.shards; pass --shards DIR, a directory written by "
                             "`python -m data_prep synth`")
    try:
        info, queries = read_queries(shards, "val")
        ds = ShardDataset(shards, "val", verify="none")
    except DataPrepError as err:
        raise EvalInputError(f"--tasks synth: {err}") from None
    n = len(ds) if limit is None else min(limit, len(ds))
    tokens = torch.from_numpy(ds.read_rows(np.arange(n, dtype=np.int64)).astype(np.int64))
    queries = queries[queries[:, 0] < n]
    order = np.lexsort((queries[:, 1], queries[:, 0]))
    return SynthSet(info["task"], tokens, queries[order].astype(np.int64), int(ds.manifest["tokenizer"]["vocab_size"]))


def score_answers(scorer, data: SynthSet, world: World | None = None, autocast=contextlib.nullcontext,
                  progress=None) -> tuple[np.ndarray, np.ndarray]:
    """(correct [Q] bool, nats [Q]) of every query at the scorer's depth: one forward per row, batches of the
    scorer's batch size shared over the world, gathered in query order."""
    world = world or World()
    size, rows = scorer.batch_size, len(data.tokens)
    starts = list(range(0, rows, size))
    bounds = np.searchsorted(data.queries[:, 0], starts + [rows])
    out = {}
    for b in world.mine(len(starts)):
        q = data.queries[bounds[b]:bounds[b + 1]]
        with autocast():
            logits = scorer.logits(data.tokens[starts[b]:starts[b] + size, :-1])
        picked = logits[torch.from_numpy(q[:, 0] - starts[b]), torch.from_numpy(q[:, 1] - 1)].float().cpu()
        answers = data.tokens[q[:, 0], q[:, 1]]
        nats = -F.log_softmax(picked, dim=-1).gather(-1, answers[:, None])[:, 0]
        out[b] = ((picked.argmax(-1) == answers).numpy(), nats.double().numpy())
        if progress is not None:
            progress.update(1)
    out = world.gather(out)
    return (np.concatenate([out[b][0] for b in range(len(starts))]),
            np.concatenate([out[b][1] for b in range(len(starts))]))


def summarize(correct: np.ndarray, nats: np.ndarray, hops: np.ndarray, seed: int = 0) -> dict[int, dict]:
    """{hops: {"acc", "acc_lo", "acc_hi", "loss", "loss_lo", "loss_hi", "n"}}: means over the queries of each
    difficulty with 95% percentile-bootstrap intervals (NaN with fewer than 2 queries)."""
    from megaloop.eval.depth_eval import bootstrap_ratio

    table = {}
    for k in sorted(set(hops.tolist())):
        right, loss = correct[hops == k].astype(np.float64), nats[hops == k]
        ones = np.ones(len(right))
        acc_lo, acc_hi = bootstrap_ratio(right, ones, seed)
        loss_lo, loss_hi = bootstrap_ratio(loss, ones, seed)
        table[int(k)] = {"acc": float(right.mean()), "acc_lo": acc_lo, "acc_hi": acc_hi, "loss": float(loss.mean()),
                         "loss_lo": loss_lo, "loss_hi": loss_hi, "n": int(len(right))}
    return table


def evaluate_synth(model, shards, depths, seed: int = 0, batch_size: int = 16, world: World | None = None,
                   limit: int | None = None, autocast=contextlib.nullcontext, progress=None) -> dict:
    """The table of the module docstring for `model` on the val split of the synth dataset `shards` (its first
    `limit` rows), at each T in `depths`."""
    from megaloop.eval.scoring import Scorer

    data = read_synth(shards, limit)
    if data.vocab_size > model.cfg.vocab_size:
        raise EvalInputError(f"--tasks synth: {shards} uses {data.vocab_size} token ids, the model knows "
                             f"{model.cfg.vocab_size}; evaluate on a dataset of the task the model was trained on")
    if data.tokens.shape[1] - 1 > model.cfg.seq_len:
        raise EvalInputError(f"--tasks synth: the rows of {shards} hold {data.tokens.shape[1] - 1} positions, more "
                             f"than the model's seq_len {model.cfg.seq_len}; make the dataset with --seq-len "
                             f"{model.cfg.seq_len}")
    by_depth = {}
    for depth in depths:
        scorer = Scorer(model, depth, seed, batch_size, world)
        correct, nats = score_answers(scorer, data, world, autocast, progress)
        by_depth[int(depth)] = summarize(correct, nats, data.queries[:, 2], seed)
    return {"task": data.task, "rows": len(data.tokens), "queries": len(data.queries), "by_depth": by_depth}


def evaluate_checkpoint(checkpoint, depths, shards=None, seed: int | None = None, batch_size: int = 16,
                        limit: int | None = None, device: str = "cpu") -> dict:
    """evaluate_synth for a run directory or checkpoint (fp32, one process); shards and seed default to the run's
    data.shards and train.seed."""
    from megaloop.eval.checkpoint import load_model

    loaded = load_model(checkpoint, device=device)
    shards = shards or loaded.config.get("data", {}).get("shards")
    seed = int(loaded.config.get("train", {}).get("seed", 0)) if seed is None else seed
    return evaluate_synth(loaded.model, shards, depths, seed, batch_size, limit=limit)


def format_synth(result: dict) -> list[str]:
    """The table as report lines."""
    lines = [f"synth task {result['task']} ({result['rows']} val rows, {result['queries']} answers; 95% bootstrap "
             "CI over answers):", "    T  hops  accuracy [95% CI]         loss [95% CI]            n"]
    for t, table in result["by_depth"].items():
        for k, r in table.items():
            lines.append(f"  {t:>3}  {k:>4}  {r['acc']:.4f} [{r['acc_lo']:.4f}, {r['acc_hi']:.4f}]  {r['loss']:.4f} "
                         f"[{r['loss_lo']:.4f}, {r['loss_hi']:.4f}]  {r['n']}")
    return lines
