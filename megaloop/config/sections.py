"""The non-model sections of the config tree: parallel layout, data, training loop, checkpoints."""
from __future__ import annotations

from dataclasses import dataclass, field

from megaloop.config.errors import ConfigError, check_choice


@dataclass
class ParallelConfig:
    """Parallel layout. dp None: world_size / (tp * pp)."""

    tp: int = 1
    pp: int = 1
    pp_in_flight: int = 3  # pp > 1: at most pp_in_flight x pp micro-batches hold lap activations at once (the ring
    #                        schedule's memory bound; `python -m megaloop plan --pp` shows the memory it takes)
    pp_split: str = "even"  # pp > 1: core blocks per stage: even (sizes differ by at most one) | balanced (fewer on
    #                         the end stages, which also run the prelude or the coda and head)
    pp_message_dtype: str | None = None  # pp > 1: the dtype of the states and gradients sent between stages: fp32 |
    #                                       bf16 (None: the compute dtype, bf16 under train.precision=bf16)
    dp: int | None = None
    sequence_parallel: bool | None = None  # None: on when tp > 1
    engine: str = "native"  # native | deepspeed
    zero_stage: int = 1
    zero_offload: bool = False  # deepspeed engine: optimizer state and step on the CPU (ZeRO-Offload)
    backend: str = "auto"  # auto (nccl on GPU, gloo on CPU) | gloo | nccl
    p2p_semantics: str = "auto"  # pp > 1: auto (the backend's: NCCL's rendezvous, gloo's asynchronous sends) |
    #                                rendezvous (NCCL's on gloo too: a send completes only when its receive does and
    #                                one group's batches run in order, so CPU runs hang where NCCL would)
    timeout_s: float = 600.0  # a collective waiting longer fails the job (a lost rank must not hang the others)
    startup_timeout_s: float = 1800.0  # the same for start-up (rendezvous, build, restore) and checkpoint saves,
    #                                     where ranks legitimately wait longer on each other (pipeline/layout.py)
    grad_reduce_dtype: str = "fp32"  # fp32: gradients cross the wire in their own dtype | bf16: cast for the wire
    grad_bucket_elements: int | None = None  # elements per dp reduction/all-gather bucket; None: max(40M, 1M x dp)
    overlap_param_gather: bool = True  # ZeRO-1: the parameter all-gather runs under the next step's forward
    grad_buckets: str = "backward"  # backward: buckets in the order backward finishes gradients, the embeddings'
    #                                 own last | columns: the earlier layout, every bucket waits for the embeddings
    dp_balance: str | None = None  # depth: deal sequences to dp ranks by loop work | rows: equal rows (None: depth,
    #                                 rows under the DeepSpeed engine, whose accumulation count is fixed)

    def validate(self) -> None:
        for name in ("tp", "pp", "pp_in_flight"):
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name}", getattr(self, name), "must be >= 1")
        if self.dp is not None and self.dp < 1:
            raise ConfigError("parallel.dp", self.dp, "must be >= 1 or null (derived from the world size)")
        check_choice("parallel.engine", self.engine, ("native", "deepspeed"))
        check_choice("parallel.pp_split", self.pp_split, ("even", "balanced"))
        check_choice("parallel.backend", self.backend, ("auto", "gloo", "nccl"))
        check_choice("parallel.p2p_semantics", self.p2p_semantics, ("auto", "rendezvous"))
        check_choice("parallel.grad_reduce_dtype", self.grad_reduce_dtype, ("fp32", "bf16"))
        check_choice("parallel.grad_buckets", self.grad_buckets, ("backward", "columns"))
        if self.pp_message_dtype is not None:
            check_choice("parallel.pp_message_dtype", self.pp_message_dtype, ("fp32", "bf16"))
        if self.dp_balance is not None:
            check_choice("parallel.dp_balance", self.dp_balance, ("depth", "rows"))
        if self.grad_bucket_elements is not None and self.grad_bucket_elements < 1:
            raise ConfigError("parallel.grad_bucket_elements", self.grad_bucket_elements,
                              "must be >= 1 or null (max(40M, 1M x dp) elements)")
        for name in ("timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"parallel.{name}", getattr(self, name), "must be > 0 seconds")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError("parallel.zero_stage", self.zero_stage, "allowed values: 0, 1, 2, 3")


@dataclass
class DataConfig:
    """Where batches come from. shards: a directory written by `python -m data_prep shards`, or the s3://bucket/prefix
    or http(s):// URL it was uploaded to (streamed through a node cache; data_prep/sources.py), or a list of these
    (several corpora, each global batch holding round(mix_c x global_batch_size) rows of corpus c;
    data_prep/mixture.py)."""

    shards: str | list[str] | None = None
    mix: list[float] | None = None  # weights of the corpora of a list data.shards (None: proportional to their rows)
    micro_batch_size: int = 8
    global_batch_size: int = 32
    verify: str = "fast"  # full | fast | none
    on_corrupt: str = "error"  # error | skip
    prefetch: int = 4
    val_batches: int = 8  # validation set: the first val_batches x micro_batch_size rows of the val split (any layout)
    order: str | None = None  # global (a full permutation of the rows) | blocks (shards in groups of block_shards,
    #                           rows shuffled within one; touches few shards at a time). None: blocks for s3:// and
    #                           http(s):// shards, global for a local directory
    block_shards: int = 8
    cache_dir: str | None = None  # streamed shards' node cache (None: $MEGALOOP_SHARD_CACHE or $TMPDIR/megaloop-shards)
    cache_gib: float = 64.0  # its bound; the least recently used shards are deleted to stay under it
    s3_endpoint: str | None = None  # an S3-compatible store's URL (None: AWS_ENDPOINT_URL(_S3) or AWS itself)
    prefetch_steps: int = 8  # streamed shards of the next prefetch_steps batches are downloaded ahead
    retries: int = 6  # attempts per object on connection resets, timeouts and 5xx, before a clear error
    retry_backoff_s: float = 0.5  # the first wait between attempts, doubled after each
    packing: str | None = None  # bestfit | stream: how the shards must have been packed (`data_prep shards
    #                              --packing`, recorded in their manifest; older manifests: stream); None: either
    max_epochs: int | None = None  # end the run (saved, COMPLETED) before a batch that would hold a sample of epoch
    #                                 max_epochs (0-based), i.e. after max_epochs passes over the corpus (of a mix:
    #                                 over the first of its corpora to get there)

    def validate(self) -> None:
        for name in ("micro_batch_size", "global_batch_size", "prefetch", "block_shards", "retries"):
            if getattr(self, name) < 1:
                raise ConfigError(f"data.{name}", getattr(self, name), "must be >= 1")
        if self.order is not None:
            check_choice("data.order", self.order, ("global", "blocks"))
        if isinstance(self.shards, list) and not self.shards:
            raise ConfigError("data.shards", self.shards, "an empty list; give one or more shard directories or URLs")
        if self.mix is not None:
            corpora = len(self.shards) if isinstance(self.shards, list) else 1
            if len(self.mix) != corpora or min(self.mix) < 0 or not sum(self.mix) > 0:
                raise ConfigError("data.mix", self.mix, f"must hold one weight >= 0 per corpus of data.shards "
                                  f"({corpora}), with a positive sum, e.g. data.mix=[0.7,0.3]")
        if not self.cache_gib > 0:
            raise ConfigError("data.cache_gib", self.cache_gib, "must be > 0 (GiB of node-local disk for shards)")
        if self.prefetch_steps < 0 or self.retry_backoff_s < 0:
            raise ConfigError("data.prefetch_steps" if self.prefetch_steps < 0 else "data.retry_backoff_s",
                              min(self.prefetch_steps, self.retry_backoff_s), "must be >= 0")
        if self.val_batches < 0:
            raise ConfigError("data.val_batches", self.val_batches, "must be >= 0")
        if self.max_epochs is not None and (isinstance(self.max_epochs, bool) or not isinstance(self.max_epochs, int)
                                            or self.max_epochs < 1):
            raise ConfigError("data.max_epochs", self.max_epochs, "must be an integer >= 1 (passes over the corpus) "
                              "or null")
        if self.packing is not None:
            check_choice("data.packing", self.packing, ("bestfit", "stream"))
        check_choice("data.verify", self.verify, ("full", "fast", "none"))
        check_choice("data.on_corrupt", self.on_corrupt, ("error", "skip"))


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = 1000  # optimizer steps; or give train.tokens instead (exactly one of the two)
    tokens: int | str | None = None  # the run's budget in tokens (104e9, 104B): steps = ceil(tokens / (global batch x
    #                              seq_len)), resolved when the config is loaded (megaloop/config/budget.py)
    out_dir: str = "runs/default"
    seed: int = 0
    precision: str = "auto"  # auto (bf16 where native, else fp32) | bf16 | fp32 | fp64 (see train/precision.py)
    device: str = "auto"  # auto | cpu | cuda
    log_every: int = 1
    val_every: int = 100
    val_depths: list[int] | None = None  # None: 1, 2, 4, mu_rec, 2 mu_rec
    bucket_depths: bool = True
    progress: bool = True
    stop_at_step: int | None = None  # end this job after this step (save, exit 75); the schedule spans train.steps
    extend: str = "continue"  # a resumed run given a larger train.steps than it started with: continue (the learning
    #                           rate keeps the schedule it started with, then its last rate) | rewarm (the schedule
    #                           spans the new train.steps: the rate rises again if the run had cooled down)
    time_limit_s: float | None = None  # this job's wall-clock budget: stop and save in time (also MEGALOOP_DEADLINE)
    max_consecutive_skips: int = 20  # stop when this many steps in a row had a non-finite gradient norm
    on_spike: str = "log"  # a loss spike (loss > rolling median + spike_k x MAD): log | skip (drop the step's
    #                        update) | rollback (restore the last checkpoint, skip the batches up to the spike) |
    #                        stop (stop without saving the damaged state); see megaloop/train/spikes.py
    spike_k: float = 6.0
    spike_window: int = 50  # the rolling median and MAD are over this many recent losses
    rollback_skip: int = 16  # train.on_spike=rollback: global batches skipped, a window ending at the spike's
    max_rollbacks: int = 3  # rollbacks in one run before a further spike stops it (as train.on_spike=stop)
    heartbeat_every: int = 10  # each rank appends its progress to <out_dir>/heartbeat/ every N steps (0: never)
    activation_checkpointing: str = "none"  # none | block (recompute each block) | lap (recompute a whole kept lap)
    compile: bool | str = "auto"  # torch.compile each block once (the loop calls it T times; prefix sizes dynamic):
    #                               true | false | auto (on a GPU only: the CPU's compile time outweighs its gain)
    fp8: str = "none"  # none | tensorwise | rowwise: the core's linear layers in FP8, current scaling (pipeline/fp8.py)
    fp8_backend: str = "torchao"  # torchao (torchao's recipes on torch._scaled_mm, CPU and GPU) | te (GPU only)
    fp8_prelude_coda: bool = False  # also the prelude's and coda's linear layers (head, embeddings, injection: never)
    fp8_scale_rounding: str = "auto"  # auto (torchao's recipes: rowwise pow2, tensorwise none) | pow2 | none
    wandb: str = ""  # a Weights & Biases project ("project" or "entity/project"; "": off): rank 0 logs the
    #                  metrics.jsonl records to one W&B run per out_dir (megaloop/train/wandb_log.py)

    def compiles(self, device_type: str) -> bool:
        """Whether the blocks are compiled on a device of this type (train.compile auto: on CUDA only)."""
        return device_type == "cuda" if self.compile == "auto" else bool(self.compile)

    def validate(self) -> None:
        if self.steps < 1:
            raise ConfigError("train.steps", self.steps, "must be >= 1")
        check_choice("train.precision", self.precision, ("auto", "bf16", "fp32", "fp64"))
        check_choice("train.device", self.device, ("auto", "cpu", "cuda"))
        check_choice("train.extend", self.extend, ("continue", "rewarm"))
        check_choice("train.activation_checkpointing", self.activation_checkpointing, ("none", "block", "lap"))
        if self.compile not in (True, False, "auto"):
            raise ConfigError("train.compile", self.compile, "allowed values: true, false, auto")
        check_choice("train.fp8", self.fp8, ("none", "tensorwise", "rowwise"))
        check_local("train.out_dir", self.out_dir)
        check_choice("train.fp8_backend", self.fp8_backend, ("torchao", "te"))
        check_choice("train.fp8_scale_rounding", self.fp8_scale_rounding, ("auto", "pow2", "none"))
        if self.fp8_scale_rounding != "auto" and self.fp8_backend == "te":
            raise ConfigError("train.fp8_scale_rounding", self.fp8_scale_rounding, "the te backend runs Transformer "
                              "Engine's Float8CurrentScaling as it is: use auto, or train.fp8_backend=torchao")
        if self.fp8 == "rowwise" and self.fp8_backend == "te":
            raise ConfigError("train.fp8", self.fp8, "Transformer Engine runs tensorwise current scaling in the loop "
                              "(Float8CurrentScaling): set train.fp8=tensorwise, or train.fp8_backend=torchao")
        for name in ("log_every", "val_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name}", getattr(self, name), "must be >= 1")
        if self.stop_at_step is not None and not 1 <= self.stop_at_step:
            raise ConfigError("train.stop_at_step", self.stop_at_step, "must be >= 1 or null")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise ConfigError("train.time_limit_s", self.time_limit_s, "must be > 0 seconds or null")
        if self.max_consecutive_skips < 1:
            raise ConfigError("train.max_consecutive_skips", self.max_consecutive_skips, "must be >= 1")
        check_choice("train.on_spike", self.on_spike, ("log", "skip", "rollback", "stop"))
        for name in ("rollback_skip", "max_rollbacks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name}", getattr(self, name), "must be >= 1")
        if self.heartbeat_every < 0:
            raise ConfigError("train.heartbeat_every", self.heartbeat_every, "must be >= 0 (0: no heartbeat files)")
        if not self.spike_k > 0 or self.spike_window < 2:
            raise ConfigError("train.spike_k" if not self.spike_k > 0 else "train.spike_window",
                              self.spike_k if not self.spike_k > 0 else self.spike_window,
                              "spike_k must be > 0 and spike_window >= 2")
        if self.val_depths is not None and (not self.val_depths or min(self.val_depths) < 1):
            raise ConfigError("train.val_depths", self.val_depths, "a non-empty list of depths >= 1, or null")
        check_wandb("train.wandb", self.wandb)


@dataclass
class CheckpointConfig:
    """Sharded zarr checkpoints (checkpoints/; megaloop/train/checkpointing/). A run saves at its end and every
    `every` steps; re-running the same command (same out_dir, a larger train.steps) continues from the newest
    committed checkpoint by itself."""

    dir: str | None = None  # None: <train.out_dir>/checkpoints
    every: int = 0  # also every N steps (0: by steps never)
    every_minutes: float | str = "auto"  # also every N minutes of training, agreed by every rank (0: never); auto:
    #                                      the interval at which the measured save stall costs ~2% of the time,
    #                                      within [AUTO_MIN_MINUTES, AUTO_MAX_MINUTES] (megaloop/train/cadence.py)
    keep: int = 2  # committed checkpoints kept (the newest)
    resume: str | None = None  # another run's checkpoint (a step directory or a checkpoint root) to start from
    load_optimizer: bool = True  # false: take the weights of checkpoint.resume only (new optimizer, data from 0)
    async_save: bool = True  # write in the background (the next save waits for the previous one)

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError("checkpoint.every", self.every, "must be >= 0 (0: no saves by step count)")
        if self.every_minutes != "auto" and (isinstance(self.every_minutes, (bool, str))
                                             or not self.every_minutes >= 0):
            raise ConfigError("checkpoint.every_minutes", self.every_minutes, "must be auto, or minutes >= 0 "
                              "(0: no time-based saves)")
        if self.keep < 1:
            raise ConfigError("checkpoint.keep", self.keep, "must be >= 1")
        for name in ("dir", "resume"):
            check_local(f"checkpoint.{name}", getattr(self, name))


def check_local(field_name: str, value) -> None:
    """A path key that megaloop writes or reads on the local (or shared) file system refuses a URL, which would
    otherwise become a folder named like `s3:` in the current directory."""
    from data_prep.paths import local_path_error

    problem = value is not None and local_path_error(str(value))
    if problem:
        raise ConfigError(field_name, value, problem)


def check_wandb(field_name: str, target: str) -> None:
    """train.wandb: empty (off), or "project" / "entity/project" with the wandb package installed (looked up, not
    imported: megaloop imports wandb only when it logs)."""
    if not target:
        return
    parts = target.split("/")
    if len(parts) > 2 or not all(parts) or any(c in target for c in "\\#?%:"):
        raise ConfigError(field_name, target, 'a W&B project, "project" or "entity/project" (none of \\ # ? % :); '
                          '"" turns W&B logging off')
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(field_name, target, "the wandb package is not installed: pip install -r "
                          'requirements-wandb.txt (or train.wandb="" to train without W&B)')


def default_factory(cls):
    return field(default_factory=cls)
