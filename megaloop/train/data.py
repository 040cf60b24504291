"""The trainer's view of the data: this rank's share of each global batch and the validation batches, from a
shard directory written by `python -m data_prep shards` (data_prep.loader does the work).

Which rows of a global batch a data-parallel rank reads (cfg.dp_balance): "depth" deals the sequences by their whole
cost in FLOPs, non-loop + no-grad laps x c_ng + grad laps x c_g (megaloop.depth.balance.deal_by_depth with
row_costs from the FLOP model; ranks may hold different numbers of rows), "rows" gives every rank the same
rows and micro-batch count (depth buckets dealt by assign_buckets_to_ranks; the contiguous share when
train.bucket_depths is off). Both are pure functions of the sampled depths, i.e. of (seed, step, sample index), so
every rank computes the same dealing and reads only its own rows; the order and the resume state do not change.

Under tensor or pipeline parallelism one rank per data-parallel replica reads the rows and the others receive them
(pipeline.replica_data.ReplicaReader, given the runtime's layout): the batches are the same tensors, read once."""
from __future__ import annotations

import itertools
import os
import sys

from megaloop.config import Config, ConfigError


class ShardData:
    """The trainer's DataSource (megaloop.train.protocols). pin: the training batches' tokens pinned in the
    loader's prefetch thread (`pin_batches`); layout: see open_data."""

    bytes_per_token: float | None  # of the val split's text (None: unknown), set from the manifest

    def __init__(self, cfg: Config, dp_rank: int, dp_size: int, layout=None, pin: bool = False, gather=None):
        from data_prep.loader import ShardLoader

        d = cfg.data
        self.cfg, self.dp_rank, self.dp_size = cfg, dp_rank, dp_size
        self.sources = shard_sources(cfg)
        self.source = self.sources[0]  # validation reads the first corpus of a mix
        self.manifest = self.source.manifest()
        self.pad_id = self.manifest["tokenizer"].get("pad_id")  # every batch carries it: labels.py masks its targets
        for source in self.sources:
            if source.streams:  # a local manifest was checked with the config (megaloop.config.tree)
                _check_remote_manifest(cfg, source.manifest(), source.url)
        self.replica = _replica_reader(layout)
        mixed = isinstance(d.shards, list)
        self.loader = ShardLoader(self.sources if mixed else self.source, d.global_batch_size, dp_rank, dp_size,
                                  seed=cfg.train.seed, verify=d.verify, on_corrupt=d.on_corrupt, prefetch=d.prefetch,
                                  select=rank_selection(cfg, dp_rank, dp_size), pin_memory=pin,
                                  read_tokens=self.replica is None or self.replica.reads,
                                  order=data_order(cfg), block_shards=d.block_shards, prefetch_steps=d.prefetch_steps,
                                  mix=d.mix)
        if d.on_corrupt == "skip" and gather is not None:
            _agree_on_skipped_shards(self.loader, gather, dp_rank == 0 and os.environ.get("RANK", "0") == "0")
        self.bytes_per_token = _bytes_per_token(self.manifest, "val")
        self._val = None
        self._ahead = None  # the training iterator whose first batch read_first_batch read
        self.val_rows = self.manifest["splits"].get("val", {}).get("rows", 0) if d.val_batches else 0
        if not self.val_rows and dp_rank == 0 and os.environ.get("RANK", "0") == "0":
            if d.val_batches:
                print(f"megaloop: note: {self.source.url} has no val split, so there is no validation loss (reported "
                      "as n/a); shards made with --val-fraction > 0 (default 0.01) hold one", file=sys.stderr)
            else:
                print("megaloop: note: validation is off (data.val_batches=0): no validation loss (reported as n/a)",
                      file=sys.stderr)

    def train_batches(self):
        """The training batches from the loader's position (the one read_first_batch read first)."""
        batches, self._ahead = self._ahead or self._shared(iter(self.loader)), None
        return batches

    def prepare_ahead(self, prepare) -> None:
        """Run prepare(step, batch) on each training batch in the loader's prefetch thread (None: nothing); set
        before the first batch is read."""
        self.loader.prepare = prepare

    def read_first_batch(self) -> None:
        """Read the next training batch now, so that a data error (an unreadable shard) surfaces before the run
        writes any file; train_batches yields it first."""
        batches = self._shared(iter(self.loader))
        self._ahead = itertools.chain([next(batches)], batches)

    def _shared(self, batches):
        """The batches, each with the shards' pad_id, with the replica reader's tokens (as they are, when this rank
        reads for itself alone)."""
        if self.replica is None or not self.replica.shares:
            yield from ({**batch, "pad_id": self.pad_id} for batch in batches)
            return
        for batch in batches:
            yield {**batch, "tokens": self.replica.share(batch["tokens"]), "pad_id": self.pad_id}

    @property
    def rows_read(self) -> int:
        """Training rows this rank has read from the shards (0 on a replica's ranks that receive them)."""
        return self.loader.dataset.rows_read

    @property
    def val_row_count(self) -> int:
        """The validation rows: the first data.val_batches x data.micro_batch_size of the val split (fewer when the
        split is smaller), the same set whatever the layout (the dp ranks share them)."""
        return min(self.val_rows, self.cfg.data.val_batches * self.cfg.data.micro_batch_size)

    def val_batches(self) -> list[dict]:
        """The validation rows (val_row_count) in global batches of micro_batch_size x dp rows; padding rows (the
        last batch's) get label -100. Empty without a val split (validation then reports n/a, as the note at start
        says)."""
        if self._val is None and not self.val_rows:
            self._val = []
        if self._val is None:
            from data_prep.loader import validation_batches

            d = self.cfg.data
            self._val = [{**batch, "pad_id": self.pad_id} for batch in validation_batches(
                self.source, d.micro_batch_size * self.dp_size, self.dp_rank, self.dp_size, verify="none",
                on_corrupt=d.on_corrupt, rows=self.val_row_count)]
        return self._val

    def epoch_of(self, batch: int) -> int:
        """The newest epoch among the samples of global batch `batch` (the same on every rank: a function of the
        order alone; of a mix, the newest of its corpora's)."""
        import numpy as np

        G = self.cfg.data.global_batch_size
        return int(self.loader.order.rows_at(np.arange(batch * G, (batch + 1) * G, dtype=np.int64))[1].max())

    def stream_stats(self) -> dict:
        """This process's shard I/O so far: bytes_downloaded, downloads, hits, hit_ratio, retries, evicted (a
        local directory: zeros and ratio 1) and shards_skipped (left out under data.on_corrupt=skip)."""
        return {**self.loader.dataset.source.stats(), "shards_skipped": len(self.loader.skipped)}

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue reading from `state` (a resumed run's position, from state_dict)."""
        self.loader.load_state_dict(state)
        self._ahead = None

    def seek(self, batch: int) -> None:
        """Make global batch `batch` the next one train_batches() yields (a rollback's skipped window); nothing to do
        when it is already (a batch read ahead by read_first_batch is kept then)."""
        position = self.loader.step - (1 if self._ahead is not None else 0)
        if batch != position:
            self.loader.load_state_dict({**self.loader.state_dict(), "step": batch})
            self._ahead = None

    def close(self) -> None:
        self.loader.close()
        if self.replica is not None:
            self.replica.close()


def shard_sources(cfg: Config) -> list:
    """data.shards as data_prep ShardSources (one per corpus): a local directory, or s3:// / http(s):// behind the
    node cache."""
    from data_prep.sources import open_source
    from data_prep.stores import RetryPolicy

    d = cfg.data
    policy = RetryPolicy(attempts=d.retries, backoff_s=d.retry_backoff_s)
    return [open_source(one, d.cache_dir, d.cache_gib, d.s3_endpoint, policy) for one in _corpora(cfg)]


def _corpora(cfg: Config) -> list[str]:
    return cfg.data.shards if isinstance(cfg.data.shards, list) else [cfg.data.shards]


def _check_remote_manifest(cfg: Config, manifest: dict, url: str) -> None:
    """The checks the config makes of a local manifest, for one read from a store: vocabulary, seq_len, the packing
    data.packing asks for, and under model.doc_mask the BOS id the config was given (megaloop.config.tree)."""
    from megaloop.config.documents import frames_documents_with_bos, manifest_bos_id
    from megaloop.config.tree import check_packing

    cfg.model.check_vocab_covers(manifest["tokenizer"]["vocab_size"], f"{url}/manifest.json")
    if manifest["seq_len"] != cfg.model.seq_len:
        raise ConfigError("model.seq_len", cfg.model.seq_len, f"the shards at {url} hold rows of "
                          f"seq_len={manifest['seq_len']}; set model.seq_len={manifest['seq_len']}")
    check_packing(cfg.data.packing, manifest, f"the shards at {url}")
    bos = manifest_bos_id(manifest)
    if cfg.model.doc_mask and (bos != cfg.model.bos_id or not frames_documents_with_bos(manifest)):
        raise ConfigError("model.bos_id", cfg.model.bos_id, f"the shards at {url} "
                          + (f"mark documents with BOS id {bos}; set model.bos_id={bos}" if bos is not None
                             and frames_documents_with_bos(manifest) else "have no BOS-framed documents (their "
                             "tokenizer has no BOS, or packing.bos_framed is false); set model.doc_mask=false"))


def data_order(cfg: Config) -> str:
    """data.order, or its default: blocks when any corpus is streamed (few shards touched at a time), else global."""
    from data_prep.stores import is_remote

    return cfg.data.order or ("blocks" if any(is_remote(one) for one in _corpora(cfg)) else "global")


def rank_selection(cfg: Config, dp_rank: int, dp_size: int):
    """select(step, sample_indices) -> this rank's positions of the global batch, or None for the contiguous share
    (one rank, or equal rows without depth buckets)."""
    if dp_size == 1 or (cfg.dp_balance == "rows" and not cfg.train.bucket_depths):
        return None
    from megaloop.depth import make_sampler
    from megaloop.depth.balance import deal_by_depth, deal_by_rows, row_costs
    from megaloop.train.flops import FlopModel

    m = cfg.model
    sampler = make_sampler(m.depth_sampler, m.mu_rec, m.backprop_depth, seed=cfg.train.seed)
    by_depth, micro = cfg.dp_balance == "depth", cfg.data.micro_batch_size
    coefficients = FlopModel.of(m).integer_coefficients()

    def select(step: int, sample_indices):
        sample = sampler.sample(step, sample_indices)
        depths = sample.T.numpy()
        if by_depth:
            ranks = deal_by_depth(depths, dp_size, row_costs(sample.n.numpy(), sample.k.numpy(), *coefficients))
        else:
            ranks = deal_by_rows(depths, dp_size, micro)
        return ranks[dp_rank]

    return select


def _agree_on_skipped_shards(loader, gather, is_main: bool) -> None:
    """data.on_corrupt=skip is one decision of the job: every rank leaves out every shard that any rank found
    unreadable (a node's damaged copy, a read error on one rank), so that all read one set of rows in one order.
    `gather(obj)`: every rank's obj (the runtime's all_gather_object). Streamed shards are checked on arrival
    against the manifest's sha256 and fetched again when a download or a cached copy is damaged, so their verdict
    is the store's bytes, the same for every rank that touches them."""
    everyone = gather(loader.skipped_names())
    if len(everyone) == 1:
        return
    union = sorted({tuple(x) for names in everyone for x in names})
    loader.agree_skipped(union)
    if is_main and any(len(names) != len(union) for names in everyone):
        print(f"megaloop: data.on_corrupt=skip: the ranks disagreed on which shards are readable; every rank leaves "
              f"out all {len(union)} that some rank could not read", file=sys.stderr, flush=True)


def _replica_reader(layout):
    """The ReplicaReader of a tensor- or pipeline-parallel layout, else None (this rank reads its own rows)."""
    if layout is None or (layout.tp == 1 and layout.pp == 1):
        return None
    from pipeline.replica_data import ReplicaReader

    return ReplicaReader(layout)


def _bytes_per_token(manifest: dict, split: str) -> float | None:
    sources = [s for s in manifest.get("sources", []) if s.get("split") == split and s.get("tokens")]
    tokens = sum(s["tokens"] for s in sources)
    return sum(s["size"] for s in sources) / tokens if tokens else None


def pin_batches(device) -> bool:
    """Whether the loader pins the training batches for `device`: on a CUDA device, where a copy from pinned
    memory with non_blocking=True is queued without making the host wait (and pinning is possible at all)."""
    from megaloop.model.transfer import pins

    return device is not None and pins(device)


def open_data(cfg: Config, dp_rank: int, dp_size: int, layout=None, device=None, gather=None) -> ShardData:
    """The run's data for data-parallel rank dp_rank of dp_size; `layout` (the runtime's
    pipeline.layout.ParallelLayout, if any) makes one rank per data-parallel replica read the rows; `device`: where
    the batches go (pin_batches); `gather` (the runtime's all_gather_object): how the ranks agree on the shards
    data.on_corrupt=skip leaves out (None: this process alone)."""
    if cfg.data.shards is None:
        raise ConfigError("data.shards", None, "set it to a directory written by `python -m data_prep shards` "
                          "(e.g. --set data.shards=runs/quickstart/shards)")
    return ShardData(cfg, dp_rank, dp_size, layout, pin=pin_batches(device), gather=gather)
