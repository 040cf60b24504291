import shutil
from pathlib import Path

import pytest

TINY = Path(__file__).resolve().parents[2] / "configs" / "parcae-tiny.yaml"


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory, shared_dir) -> Path:
    """Shards of 33-token rows from 24 real chapters (vocab 512), built with data_prep's own API."""
    from data_prep.prepare import ShardOptions, prepare_shards
    from data_prep.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("tiny_data")
    corpus = root / "corpus"
    corpus.mkdir()
    for f in sorted((shared_dir / "data" / "corpus" / "chapters").glob("*.txt"))[:24]:
        shutil.copy(f, corpus / f.name)
    train_tokenizer(corpus, root / "tok", vocab_size=512)
    prepare_shards(corpus, root / "tok", root / "shards",
                   ShardOptions(seq_len=32, val_fraction=0.1, shard_size=256, progress=False))
    return root / "shards"


def fast_overrides(shards: Path, out_dir: Path, steps: int = 6) -> list[str]:
    return [f"data.shards={shards}", f"train.out_dir={out_dir}", f"train.steps={steps}", "model.vocab_size=512",
            "model.d_model=64", "model.n_heads=2", "model.seq_len=32", "data.micro_batch_size=4",
            "data.global_batch_size=8", "data.val_batches=2", "train.progress=false", "train.val_every=3",
            "train.precision=fp32", "model.ve_gate_channels=16"]
