import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MEGALOOP_SHARED", REPO.parent / "shared"))
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# the CPU peaks that training runs measure go to a cache of this session (inherited by every process it starts):
# measured while the suite loads the cores, they would be low, and they must not stay in the user's cache
os.environ.setdefault("MEGALOOP_CACHE_DIR", tempfile.mkdtemp(prefix="megaloop-test-cache-"))
# torch.compile's kernels likewise: a machine-wide /tmp/torchinductor_<user> left by an interrupted run, or by a run
# under another CPU capability (ATEN_CPU_CAPABILITY), made the compile test abort; each session compiles afresh
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="megaloop-test-inductor-"))
# Hugging Face libraries never reach the network in tests, and the remote code of the folders tests export is
# cached in this session's own directory, not in the user's ~/.cache/huggingface
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_MODULES_CACHE", tempfile.mkdtemp(prefix="megaloop-test-hf-modules-"))


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The shared data folder that sits beside the checkout (corpus, eval sets)."""
    if not (SHARED / "data").is_dir():
        pytest.skip(f"shared data not found at {SHARED} (set MEGALOOP_SHARED)")
    return SHARED


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
