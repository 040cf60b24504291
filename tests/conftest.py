import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MEGALOOP_SHARED", REPO.parent / "shared"))
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


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
