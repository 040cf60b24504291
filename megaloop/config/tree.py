"""The one config tree: model, parallel, data, optim, train, checkpoint; validated as a whole before any work."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from megaloop.config.errors import ConfigError
from megaloop.config.fp8_layers import no_fp8_layer_reason
from megaloop.config.model import ModelConfig
from megaloop.config.pipeline import check_pipeline
from megaloop.config.sections import CheckpointConfig, DataConfig, ParallelConfig, TrainConfig
from megaloop.optim.config import OptimConfig, OptimConfigError


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self, world_size: int | None = None) -> "Config":
        """Check every section, then the sizes that depend on each other. Returns self."""
        for section in (self.model, self.parallel, self.data, self.optim, self.train, self.checkpoint):
            try:
                section.validate()
            except OptimConfigError as err:  # the optim section reports in its own (dependency-free) type
                raise ConfigError(err.field, err.value, f"allowed values are {err.allowed}") from None
        p, d = self.parallel, self.data
        fits = world_size is not None and world_size % (p.tp * p.pp) == 0
        check_pipeline(p.pp, self.model.n_core, p.engine, d.global_batch_size, d.micro_batch_size,
                       p.dp or (self.dp_size(world_size) if fits else 1))
        self._validate_batches(world_size)
        self._validate_engine()
        self._validate_backend()
        self._validate_data_dir()
        self.model.require_bos()  # doc_mask: given, or filled from the shards' manifest just above
        self._validate_fp8()
        return self

    def _validate_fp8(self) -> None:
        """train.fp8 asked for explicitly where no block layer qualifies would train in bf16 under an FP8 header."""
        if self.train.fp8 == "none":
            return
        reason = no_fp8_layer_reason(self.model, self.parallel.tp)
        if reason is not None:
            raise ConfigError("train.fp8", self.train.fp8, reason)

    def _validate_backend(self) -> None:
        """gloo with a CUDA device: gloo stages CUDA tensors through host memory and lacks collectives the trainer
        runs (reduce-scatter), so it would fail mid-run or crawl; refused here."""
        if self.parallel.backend != "gloo" or self.train.device == "cpu":
            return
        if self.train.device == "auto":
            import torch  # only for this combination: the config tree does not need torch otherwise

            if not torch.cuda.is_available():
                return
        raise ConfigError("parallel.backend", "gloo", f"with a CUDA device (train.device={self.train.device}) "
                          "gloo copies every tensor through host memory and has no reduce-scatter; use "
                          "parallel.backend=auto (nccl on GPUs), or train.device=cpu to train on the CPU with gloo")

    def _validate_engine(self) -> None:
        """What each data-parallel engine can run (see pipeline/runtime.py and pipeline/deepspeed_engine.py)."""
        p = self.parallel
        if p.engine == "native":
            if p.zero_offload:
                raise ConfigError("parallel.zero_offload", p.zero_offload, "CPU offload of the optimizer runs under "
                                  "parallel.engine=deepspeed only")
            if p.zero_stage not in (0, 1):
                raise ConfigError("parallel.zero_stage", p.zero_stage, "the native engine runs ZeRO stage 0 or 1; "
                                  "use parallel.engine=deepspeed for stages 2 and 3 (AdamW only)")
            return
        reasons, fixes = [], []
        if p.zero_stage not in (1, 2, 3):
            reasons.append(f"parallel.zero_stage={p.zero_stage} (DeepSpeed runs stages 1, 2, 3)")
            fixes.append("parallel.zero_stage=1")
        if self.optim.name != "adamw":
            reasons.append(f"optim.name={self.optim.name} (ZeRO partitions matrices by elements, so no rank holds a "
                           "whole matrix for Muon)")
            fixes.append("optim.name=adamw")
        if p.tp != 1 or p.pp != 1:
            reasons.append(f"parallel.tp={p.tp}, parallel.pp={p.pp} (DeepSpeed is data-parallel only here, no "
                           "tensor parallelism)")
            fixes += [f"parallel.{k}=1" for k in ("tp", "pp") if getattr(p, k) != 1]
        if self.train.precision == "fp64":
            reasons.append("train.precision=fp64 (a verification precision of the native engine)")
            fixes.append("train.precision=fp32")
        if self.train.on_spike == "skip":
            reasons.append("train.on_spike=skip (DeepSpeed's engine steps its own optimizer)")
            fixes.append("train.on_spike=log")
        if p.dp_balance == "depth":
            reasons.append("parallel.dp_balance=depth (DeepSpeed runs a fixed number of micro-batches per rank)")
            fixes.append("parallel.dp_balance=rows")
        if self.checkpoint.every or self.checkpoint.resume is not None:
            reasons.append("checkpoint.every/checkpoint.resume (DeepSpeed keeps its optimizer state in its own "
                           "partitioned flat buffers, which megaloop does not save as layout-free arrays; the "
                           "native engine's checkpoints resume and reshard)")
            fixes += ["checkpoint.every=0"] * bool(self.checkpoint.every)
            fixes += ["checkpoint.resume=null"] * (self.checkpoint.resume is not None)
        if reasons:  # the native engine as the alternative only where it runs what was asked of DeepSpeed
            native = ", or use parallel.engine=native (it runs all of these)" * (p.zero_stage in (0, 1)
                                                                                and not p.zero_offload)
            raise ConfigError("parallel.engine", p.engine, "cannot run " + "; ".join(reasons) + f"; set "
                              f"{' '.join(fixes)}{native}")

    @property
    def dp_balance(self) -> str:
        """parallel.dp_balance with its default resolved: depth for the native engine, rows under DeepSpeed."""
        if self.parallel.dp_balance is not None:
            return self.parallel.dp_balance
        return "rows" if self.parallel.engine == "deepspeed" else "depth"

    def dp_size(self, world_size: int) -> int:
        if self.parallel.dp is not None:
            return self.parallel.dp
        return max(world_size // (self.parallel.tp * self.parallel.pp), 1)

    def _validate_batches(self, world_size: int | None) -> None:
        d, p = self.data, self.parallel
        if world_size is not None and p.dp is None and world_size % (p.tp * p.pp):
            fits = [t for t in range(1, world_size + 1)
                    if world_size % (t * p.pp) == 0 and self.model.n_heads % t == 0 and self.model.kv_heads % t == 0]
            raise ConfigError("parallel.tp", p.tp, f"the job's {world_size} processes are not a multiple of tp x pp "
                              f"= {p.tp} x {p.pp}; " + (f"tp values that fit this job and the model's heads: "
                              f"{fits} (or launch a multiple of {p.tp * p.pp} processes)" if fits else
                              f"launch a multiple of {p.tp * p.pp} processes"))
        dp = self.parallel.dp or (self.dp_size(world_size) if world_size else 1)
        if world_size is not None:
            needed = self.parallel.tp * self.parallel.pp * dp
            if needed != world_size:
                tp_pp = self.parallel.tp * self.parallel.pp
                hint = (f"; set parallel.dp={world_size // tp_pp} (or parallel.dp=null, derived from the job's "
                        "size)" if world_size % tp_pp == 0 else "")
                if world_size == 1:  # a plain `python -m megaloop train`: nothing would run in parallel
                    alone = " ".join(["parallel.dp=null"] + [f"parallel.{k}=1" for k in ("tp", "pp")
                                                             if getattr(self.parallel, k) != 1])
                    hint = (f"; this is a single process (not started by torchrun or Slurm): launch {needed} "
                            f"processes, e.g. `torchrun --standalone --nproc-per-node {needed} -m megaloop train "
                            f"...`, or set {alone} to train in this one process")
                raise ConfigError("parallel", f"tp={self.parallel.tp} pp={self.parallel.pp} dp={dp}",
                                  f"tp x pp x dp = {needed} but the job has {world_size} processes{hint}")
        if d.global_batch_size % (d.micro_batch_size * dp):
            raise ConfigError(
                "data.global_batch_size", d.global_batch_size,
                f"must be divisible by data.micro_batch_size x dp = {d.micro_batch_size} x {dp}; set e.g. "
                f"data.global_batch_size="
                f"{d.micro_batch_size * dp * max(d.global_batch_size // (d.micro_batch_size * dp), 1)}")

    def _validate_data_dir(self) -> None:
        if self.data.shards is None:
            return
        for one in (self.data.shards if isinstance(self.data.shards, list) else [self.data.shards]):
            self._validate_one_data_dir(one)

    def _validate_one_data_dir(self, shards) -> None:
        if str(shards).startswith(REMOTE_SHARDS):  # its manifest is checked when read (megaloop/train/data.py)
            self._check_remote_documents(shards)
            return
        original, shards = shards, Path(shards)
        manifest = shards / "manifest.json"
        if not manifest.is_file():
            raise ConfigError("data.shards", original,
                              "is not a shard directory (no manifest.json); create one with "
                              "`python -m data_prep shards --input TEXT_DIR --tokenizer TOK_DIR --output DIR`")
        remedy = "re-create the shards with `python -m data_prep shards` (`python -m data_prep inspect` checks them)"
        try:
            info = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ConfigError("data.shards", original,
                              f"{manifest} is not valid JSON ({err}); {remedy}") from None
        if not isinstance(info, dict):
            raise ConfigError("data.shards", original, f"{manifest} does not hold a JSON object; {remedy}")
        try:
            vocab = _manifest_vocab_size(info)
        except (TypeError, ValueError):
            raise ConfigError("data.shards", original, f"{manifest} holds a vocab_size that is not an "
                              f"integer; {remedy}") from None
        if vocab is not None:
            self.model.check_vocab_covers(vocab, str(manifest))
        seq_len = info.get("seq_len")
        row_len = info.get("row_len")
        if row_len is not None and (seq_len is None or row_len != seq_len + 1):
            raise ConfigError("data.shards", original,
                              f"{manifest} records seq_len={seq_len} but rows of {row_len} tokens (a row holds "
                              f"seq_len + 1): the manifest contradicts its shards; {remedy}")
        if seq_len is not None and seq_len != self.model.seq_len:
            raise ConfigError("model.seq_len", self.model.seq_len,
                              f"the shards in {shards} hold rows of seq_len={seq_len}; set model.seq_len={seq_len}")
        self._check_documents(original, manifest, info)
        check_packing(self.data.packing, info, f"the shards in {original}")

    def _check_documents(self, original, manifest: Path, info: dict) -> None:
        """model.doc_mask: the shards' tokenizer has a BOS and their documents were framed with it (see
        megaloop.config.documents); model.bos_id is filled from the manifest (or must agree with it); once the last
        corpus is checked, doc_attention_share (if null) is measured from the train rows of every corpus."""
        from megaloop.config.documents import frames_documents_with_bos, manifest_bos_id

        m = self.model
        if not m.doc_mask:
            return
        bos = manifest_bos_id(info)
        if bos is None:
            raise ConfigError("model.doc_mask", True, f"the shards in {original} were made with a tokenizer without "
                              f"a BOS token ({manifest} has no tokenizer.bos_id), so documents cannot be found; set "
                              "model.doc_mask=false or re-create the shards with a tokenizer that has <|bos|>")
        if not frames_documents_with_bos(info):
            raise ConfigError("model.doc_mask", True, f"{manifest} records that documents were not framed with BOS "
                              "(packing.bos_framed false), so documents cannot be found; set model.doc_mask=false or "
                              "re-create the shards with `python -m data_prep shards`")
        if m.bos_id is None:
            m.bos_id = bos
        elif m.bos_id != bos:
            raise ConfigError("model.bos_id", m.bos_id, f"the shards in {original} mark documents with BOS id {bos}; "
                              f"set model.bos_id={bos} (or null to take it from the manifest)")
        corpora = self.data.shards if isinstance(self.data.shards, list) else [self.data.shards]
        if m.doc_attention_share is None and original is corpora[-1]:
            self._measure_attention_share(corpora)

    def _measure_attention_share(self, corpora: list) -> None:
        """model.doc_attention_share from the train rows of the (local) corpora, weighted by data.mix."""
        from data_prep.errors import DataPrepError
        from megaloop.config.documents import measured_attention_share

        try:
            share = measured_attention_share(corpora, self.data.mix, self.model.seq_len, self.model.bos_id)
        except (DataPrepError, OSError, ValueError) as err:
            raise ConfigError("model.doc_attention_share", None, f"cannot be measured from {corpora} ({err}); set "
                              "it (the mean over rows of sum len_d^2 / seq_len^2 of the document lengths)") from None
        self.model.doc_attention_share = share

    def _check_remote_documents(self, shards) -> None:
        """model.doc_mask with streamed shards: their manifest is read only when training starts, after the model
        is built, so the BOS id and the attention share must be given."""
        m = self.model
        missing = [name for name in ("bos_id", "doc_attention_share") if m.doc_mask and getattr(m, name) is None]
        if missing:
            raise ConfigError(f"model.{missing[0]}", None, f"model.doc_mask=true with streamed shards ({shards}) "
                              f"needs {' and '.join('model.' + k for k in missing)} set in the config (the BOS id of "
                              "their manifest's tokenizer; the mean over rows of sum len_d^2 / seq_len^2)")

    def to_dict(self) -> dict:
        return asdict(self)

    def with_precision(self, precision: str) -> "Config":
        """A copy with train.precision set (how `auto` is resolved once the device is known)."""
        return replace(self, train=replace(self.train, precision=precision))


REMOTE_SHARDS = ("s3://", "http://", "https://")


def check_packing(wanted: str | None, info: dict, where: str) -> None:
    """data.packing (where set): the shards' manifest records that packing (a manifest without a record: stream, as
    data_prep packed before it recorded packing). Also called with a streamed corpus's manifest when it is read."""
    if wanted is None:
        return
    record = info.get("packing")
    mode = record.get("mode") if isinstance(record, dict) else "stream"
    if mode != wanted:
        raise ConfigError("data.packing", wanted, f"{where} were packed with {mode}; re-create them with "
                          f"`python -m data_prep shards --packing {wanted}`, or set data.packing=null to train on "
                          "them as they are")


def _manifest_vocab_size(info: dict) -> int | None:
    for key in ("vocab_size",):
        if key in info:
            return int(info[key])
    tok = info.get("tokenizer")
    if isinstance(tok, dict) and "vocab_size" in tok:
        return int(tok["vocab_size"])
    return None
