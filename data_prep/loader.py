"""The training loader: global batches in a dp-independent order, each rank's contiguous share, exact resume.

Stream position p (counted from the start of the run) reads row perm_{seed, epoch}(p mod N) with epoch = p // N
(see data_prep.order). Global batch s is positions [s*G, (s+1)*G); data-parallel rank r of dp takes positions
s*G + [r*G/dp, (r+1)*G/dp). So the set and order of rows in a global batch depends only on (seed, s), never on dp,
and every row is used exactly once per N positions (an epoch may end inside a batch; the batch simply continues
with the next epoch's order).

A loader may instead be given `select(step, sample_indices) -> positions`: which positions (indices 0..G-1 into
the global batch's run-wide sample indices s*G + [0, G)) this rank reads, e.g. rows dealt to ranks by a function of
the sample indices. It must be a pure function (the prefetch thread calls it); only the selected rows are read, and
the order and resume state above do not change.

A loader made with read_tokens=False reads no row: its batches carry the same sample_index, row_id and epoch, and
"tokens" is a zero tensor of the right shape for the one reader of a data-parallel replica to fill (every
tensor- and pipeline-parallel rank of a replica needs the same rows; see pipeline.replica_data).

Each batch is a dict (R = G/dp rows, or as many as `select` chose, in its order):
    tokens        LongTensor [R, seq_len + 1]   input_ids = tokens[:, :-1], labels = tokens[:, 1:]
    sample_index  LongTensor [R]                run-wide global sample index s*G + j (j in 0..G-1)
    row_id        LongTensor [R]                the row's id in the manifest (shard first_row + member)
    epoch         LongTensor [R]                the epoch each sample belongs to
    step          LongTensor []                 s

State: {"version", "step", "epoch", "position", "seed", "global_batch_size", "num_rows", "dataset"} where step is
the next global batch to yield. Restoring it, under any dp that divides G, continues the identical stream.
"""
from __future__ import annotations

import queue
import threading

import numpy as np
import torch

from .errors import DataPrepError, ResumeStateError
from .manifest import manifest_fingerprint
from .mixture import MixedDataset, MixOrder
from .order import make_order, rank_slice
from .shard_reader import ShardDataset

STATE_VERSION = 1
__all__ = ["ShardLoader", "ShardDataset", "validation_batches"]


def _check_layout(global_batch_size: int, dp_rank: int, dp_size: int) -> None:
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise DataPrepError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})", "pass 0 <= dp_rank < dp_size")
    if global_batch_size < 1 or global_batch_size % dp_size:
        raise DataPrepError(f"global batch size {global_batch_size} is not a positive multiple of dp size {dp_size}",
                            "choose a global batch size divisible by the number of data-parallel ranks")


class ShardLoader:
    """Streams this data-parallel rank's share of each global batch from a shard directory.

    Args:
        shard_dir: directory written by `python -m data_prep shards`, s3://bucket/prefix or http(s):// URL of one
            (streamed through the node cache, data_prep.sources), a data_prep.sources.ShardSource, or a list of
            these (several corpora mixed by `mix`).
        global_batch_size: G, rows per optimizer step over all data-parallel ranks (a multiple of dp_size).
        dp_rank, dp_size: this rank and the number of data-parallel ranks.
        seed: selects the sample order (with the epoch).
        split: "train" (default) or "val".
        verify: manifest checksum check at start-up: "full" (sha256), "fast" (sizes), "none".
        on_corrupt: "error" (raise, naming shard and member) or "skip" (leave bad shards out; see `skipped`).
        prefetch: batches prepared ahead by a background thread (0: none).
        tokenizer_hash: when given, must equal the manifest's tokenizer hash.
        select: select(step, sample_indices) -> positions of the global batch this rank reads (see the module
            docstring); None: the contiguous share of rank dp_rank.
        pin_memory: the iterator's batches hold their tokens in page-locked memory (pinned in the prefetch
            thread), so that a CUDA copy with non_blocking=True does not make the host wait. Needs CUDA.
        prepare: prepare(step, batch), called for each batch the iterator yields, before it is handed over (in
            the prefetch thread when there is one): host work for a coming step that need not wait for it. An
            exception in it reaches the consumer like a read error.
        read_tokens: False: read no row (batches hold zero tokens of the right shape, for a broadcast to fill).
        order: "global" (a full permutation of the rows per epoch) or "blocks" (block-local: shards in groups of
            block_shards, rows shuffled within a group; data_prep.order.BlockOrder). Part of the resume state.
        prefetch_steps: a streamed source downloads the shards of this rank's next prefetch_steps batches ahead.
        mix: when shard_dir is a list of corpora, their weights (None: proportional to their rows); each global
            batch holds round(w x G) rows of each (data_prep.mixture). Part of the resume state.
    """

    def __init__(self, shard_dir, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
                 split: str = "train", verify: str = "fast", on_corrupt: str = "error", prefetch: int = 2,
                 tokenizer_hash: str | None = None, select=None, pin_memory: bool = False, prepare=None,
                 read_tokens: bool = True, order: str = "global", block_shards: int = 8, prefetch_steps: int = 8,
                 mix=None):
        _check_layout(global_batch_size, dp_rank, dp_size)
        self.pin_memory, self.prepare = pin_memory, prepare
        mixed = isinstance(shard_dir, list | tuple)
        self.dataset = (MixedDataset([ShardDataset(d, split, verify, on_corrupt, tokenizer_hash) for d in shard_dir])
                        if mixed else ShardDataset(shard_dir, split, verify, on_corrupt, tokenizer_hash))
        if len(self.dataset) == 0:
            raise DataPrepError(f"split {split!r} of {shard_dir} has no rows left to read "
                                f"(skipped: {self.dataset.skipped})", "re-create the shards")
        self.global_batch_size, self.dp_rank, self.dp_size = global_batch_size, dp_rank, dp_size
        self.local_batch_size = global_batch_size // dp_size
        self.seed, self.prefetch, self.select, self.read_tokens = seed, prefetch, select, read_tokens
        self._order_args = (split, order, block_shards, mix)
        self._make_order()
        self.prefetch_steps, self._fetched_upto = prefetch_steps, 0
        self._step = 0
        self._active = None

    def _make_order(self) -> None:
        """The order over the dataset's rows (and the id a saved loader state is checked against)."""
        split, order, block_shards, mix = self._order_args
        if isinstance(self.dataset, MixedDataset):
            self.order = MixOrder(self.dataset, mix if mix is not None else [len(p) for p in self.dataset.parts],
                                  self.global_batch_size, self.seed, order, block_shards)
            fingerprint = self.dataset.fingerprint
        else:
            self.order = make_order(order, self.dataset.shard_rows, self.seed, block_shards)
            fingerprint = manifest_fingerprint(self.dataset.manifest)
        self.dataset_id = fingerprint + f"/{split}/{len(self.dataset)}" + self.order.tag

    def skipped_names(self) -> list[tuple[int, str]]:
        """(corpus index, shard name) of every shard left out under on_corrupt='skip' (index 0 without a mix)."""
        parts = self.dataset.parts if isinstance(self.dataset, MixedDataset) else [self.dataset]
        return sorted((i, s["shard"]) for i, part in enumerate(parts) for s in part.skipped)

    def agree_skipped(self, everyone: list[tuple[int, str]]) -> int:
        """Leave out every shard some rank left out (`everyone`: the union of skipped_names over the job), before
        the first batch, so that every rank reads one set of rows in one order; returns how many more this rank
        leaves out."""
        if self._active is not None:
            raise RuntimeError("agree_skipped must run before the first batch is read")
        mine = set(self.skipped_names())
        extra = sorted(set(map(tuple, everyone)) - mine)
        if not extra:
            return 0
        parts = self.dataset.parts if isinstance(self.dataset, MixedDataset) else [self.dataset]
        for index, part in enumerate(parts):
            part.exclude([name for i, name in extra if i == index], "unreadable on another rank of the job "
                         "(on_corrupt='skip' leaves it out on every rank)")
        if isinstance(self.dataset, MixedDataset):
            self.dataset = MixedDataset(parts)
        if len(self.dataset) == 0:
            raise DataPrepError(f"no rows left to read once the shards other ranks could not read are left out "
                                f"(skipped: {self.skipped})", "re-create the shards")
        self._make_order()
        return len(extra)

    @property
    def num_rows(self) -> int:
        """N, the rows in one epoch."""
        return len(self.dataset)

    @property
    def skipped(self) -> list[dict]:
        """Shards left out under on_corrupt='skip' ({"shard", "problem"} each)."""
        return self.dataset.skipped

    @property
    def steps_per_epoch(self) -> float:
        """N / G (an epoch may end inside a global batch)."""
        return self.num_rows / self.global_batch_size

    @property
    def step(self) -> int:
        """The next global batch this loader will yield."""
        return self._step

    def batch(self, step: int) -> dict:
        """This rank's share of global batch `step` (a pure function of seed, step, the layout and `select`)."""
        positions = self._positions(step)
        rows, epochs = self.order.rows_at(positions)
        if self.read_tokens:
            self._fetch_ahead(step)
            tokens = torch.from_numpy(self.dataset.read_rows(rows).astype(np.int64))
        else:
            tokens = torch.zeros((len(rows), self.dataset.row_len), dtype=torch.int64)
        return {"tokens": tokens,
                "sample_index": torch.from_numpy(positions),
                "row_id": torch.from_numpy(self.dataset.row_ids(rows)),
                "epoch": torch.from_numpy(epochs), "step": torch.tensor(step)}

    def _fetch_ahead(self, step: int) -> None:
        """Start downloading the shards of this rank's rows of the next prefetch_steps batches (streamed sources)."""
        if not self.dataset.source.streams or self.prefetch_steps <= 0:
            return
        for ahead in range(max(step + 1, self._fetched_upto), step + self.prefetch_steps + 1):
            self.dataset.prefetch_rows(self.order.rows_at(self._positions(ahead))[0])
        self._fetched_upto = step + self.prefetch_steps + 1

    def _ready(self, step: int) -> dict:
        """batch(step) as the iterator yields it: its tokens pinned when pin_memory, then `prepare` run on it (here,
        in the prefetch thread when there is one)."""
        batch = self.batch(step)
        if self.pin_memory:
            batch["tokens"] = batch["tokens"].pin_memory()
        if self.prepare is not None:
            self.prepare(step, batch)
        return batch

    def _positions(self, step: int) -> np.ndarray:
        """Run-wide sample indices of this rank's rows of global batch `step`."""
        if self.select is None:
            start, end = rank_slice(self.global_batch_size, self.dp_rank, self.dp_size)
            return step * self.global_batch_size + np.arange(start, end, dtype=np.int64)
        batch = step * self.global_batch_size + np.arange(self.global_batch_size, dtype=np.int64)
        chosen = np.asarray(self.select(step, batch))
        if (chosen.ndim != 1 or (chosen.size and not np.issubdtype(chosen.dtype, np.integer))
                or (chosen.size and (chosen.min() < 0 or chosen.max() >= self.global_batch_size))
                or np.unique(chosen).size != chosen.size):
            raise DataPrepError(f"select({step}, ...) returned {chosen!r}, not distinct positions in "
                                f"[0, {self.global_batch_size})", "return integer indices into the global batch")
        return batch[chosen.astype(np.int64)]

    def state_dict(self) -> dict:
        """Where the stream stands: restoring it continues with global batch `step`."""
        position = self._step * self.global_batch_size
        return {"version": STATE_VERSION, "step": self._step, "epoch": position // self.num_rows,
                "position": position, "seed": self.seed, "global_batch_size": self.global_batch_size,
                "num_rows": self.num_rows, "dataset": self.dataset_id}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved state (any dp size that divides the same global batch size)."""
        if state.get("version") != STATE_VERSION:
            raise ResumeStateError(f"loader state version {state.get('version')} is not {STATE_VERSION}",
                                   "resume with the data_prep version that saved it")
        expected = {"seed": self.seed, "global_batch_size": self.global_batch_size, "num_rows": self.num_rows,
                    "dataset": self.dataset_id}
        wrong = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if wrong:
            detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in wrong.items())
            raise ResumeStateError(f"the saved loader state does not fit this loader ({detail})",
                                   "resume with the same shards, seed and global batch size (dp may change)")
        self._step = int(state["step"])

    def __iter__(self):
        """Yield batches from `step` on, forever; `state_dict()` always reflects the batches already yielded."""
        if self.prefetch <= 0:
            while True:
                batch = self._ready(self._step)
                self._step += 1
                yield batch
        self._stop_prefetch()
        self._active = self._prefetched(self._step)
        yield from self._active

    def _stop_prefetch(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None

    def close(self) -> None:
        """Stop the prefetch thread of the running iteration (if any) and release the memory maps."""
        self._stop_prefetch()
        self.dataset.close_source()

    def _prefetched(self, first_step: int):
        """Batches made by a background thread, at most `prefetch` ahead of the consumer."""
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        worker = threading.Thread(target=self._produce, args=(first_step, ready, stop), daemon=True,
                                  name="data_prep-prefetch")
        worker.start()
        try:
            while True:
                step, batch, error = ready.get()
                if error is not None:
                    raise error
                self._step = step + 1
                yield batch
        finally:
            stop.set()
            while worker.is_alive():
                try:
                    ready.get(timeout=0.05)
                except queue.Empty:
                    pass
            worker.join()

    def _produce(self, step: int, ready: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                item = (step, self._ready(step), None)
            except Exception as err:  # handed to the consumer, which raises it
                item = (step, None, err)
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return
            step += 1


def validation_batches(shard_dir, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                       split: str = "val", verify: str = "fast", on_corrupt: str = "error",
                       drop_last: bool = False, tokenizer_hash: str | None = None, rows: int | None = None):
    """The validation rows in fixed order (row 0, 1, ...), global batches of G, rank r taking its contiguous share;
    `rows`: only the first that many (the same set whatever G and the layout).

    Batches carry "tokens", "sample_index" (position in the split, -1 for padding), "row_id" (-1 for padding) and
    "valid" (BoolTensor). The last global batch is padded with PAD rows (valid False) unless drop_last, so every
    rank gets the same number of batches of the same shape.
    """
    _check_layout(global_batch_size, dp_rank, dp_size)
    dataset = ShardDataset(shard_dir, split, verify, on_corrupt, tokenizer_hash)
    start, end = rank_slice(global_batch_size, dp_rank, dp_size)
    total = len(dataset) if rows is None else min(len(dataset), rows)
    n_batches = total // global_batch_size if drop_last else -(-total // global_batch_size)
    for step in range(n_batches):
        positions = step * global_batch_size + np.arange(start, end, dtype=np.int64)
        valid = positions < total
        tokens = np.full((len(positions), dataset.row_len), dataset.pad_id, dtype=np.int64)
        row_ids = np.full(len(positions), -1, dtype=np.int64)
        if valid.any():
            tokens[valid] = dataset.read_rows(positions[valid])
            row_ids[valid] = dataset.row_ids(positions[valid])
        yield {"tokens": torch.from_numpy(tokens), "sample_index": torch.from_numpy(np.where(valid, positions, -1)),
               "row_id": torch.from_numpy(row_ids), "valid": torch.from_numpy(valid), "step": torch.tensor(step)}
