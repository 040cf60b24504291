"""The model and data sizes of each scale, shared by every study so that all points train on the same shards.

smoke: toy sizes that finish in seconds per point (CI); full: the committed report's sizes, CPU-sized (parcae-tiny's
widths at 128-token rows and a 4096-id tokenizer)."""
from __future__ import annotations

from megaloop.repro.study import Scale

# per scale: tokenizer ids, row length, and the model/batch overrides every point starts from
SIZES = {
    "smoke": {"vocab_size": 512, "seq_len": 32, "tokenizer_bytes": 1_000_000, "corpus_files": 24, "val_fraction": 0.2,
              "model": {"d_model": 64, "n_heads": 2, "n_prelude": 1, "n_core": 1, "n_coda": 1},
              "micro_batch_size": 4, "global_batch_size": 8},
    "full": {"vocab_size": 4096, "seq_len": 128, "tokenizer_bytes": 8_000_000, "corpus_files": None, "val_fraction": 0.02,
             "model": {"d_model": 128, "n_heads": 4, "n_prelude": 1, "n_core": 2, "n_coda": 1},
             "micro_batch_size": 8, "global_batch_size": 16},
}


def base_overrides(scale: Scale) -> tuple[str, ...]:
    """The overrides that size a point at this scale (model widths, batch); a study's own overrides follow them."""
    s = SIZES[scale.name]
    return (*(f"model.{k}={v}" for k, v in s["model"].items()),
            f"data.micro_batch_size={s['micro_batch_size']}", f"data.global_batch_size={s['global_batch_size']}")


def runner_overrides(scale: Scale) -> tuple[str, ...]:
    """What the runner sets first on every point: the shards' vocabulary and row length, no progress bar."""
    return (f"model.vocab_size={scale.vocab_size}", f"model.seq_len={scale.seq_len}", "train.progress=false")


# the synth testbed: one k-hop dataset (`python -m data_prep synth`) per scale, shared by every point; its vocabulary
# is the task's (khop: 22 ids) and the models are configs/*-synth.yaml, resized for smoke
SYNTH_SIZES = {
    "smoke": {"task": "khop", "hops": (1, 2), "rows": 512, "val_rows": 32, "seq_len": 64, "vocab_size": 22,
              "model": ("model.d_model=32", "model.n_heads=2", "data.micro_batch_size=4", "data.global_batch_size=4",
                        "data.val_batches=2")},
    "full": {"task": "khop", "hops": (1, 2), "rows": 16384, "val_rows": 256, "seq_len": 128, "vocab_size": 22,
             "model": ()},
}
TESTBEDS = ("corpus", "synth")


def make_scale(name: str, corpus, work, max_parallel: int, budget: float = 1.0, testbed: str = "corpus") -> Scale:
    s = SYNTH_SIZES[name] if testbed == "synth" else SIZES[name]
    return Scale(name=name, corpus=corpus, work=work, max_parallel=max_parallel, budget=budget,
                 seq_len=s["seq_len"], vocab_size=s["vocab_size"], testbed=testbed)
