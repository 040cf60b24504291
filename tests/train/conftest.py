from pathlib import Path

TINY = Path(__file__).resolve().parents[2] / "configs" / "parcae-tiny.yaml"


def fast_overrides(shards: Path, out_dir: Path, steps: int = 6) -> list[str]:
    return [f"data.shards={shards}", f"train.out_dir={out_dir}", f"train.steps={steps}", "model.vocab_size=512",
            "model.d_model=64", "model.n_heads=2", "model.seq_len=32", "data.micro_batch_size=4",
            "data.global_batch_size=8", "data.val_batches=2", "train.progress=false", "train.val_every=3",
            "train.precision=fp32", "model.ve_gate_channels=16"]
