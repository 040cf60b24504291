"""Shared data of the GPU checks: shards of two bundled novels (no shared data is needed on the GPU machine)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.gpu_data import novel_shards


@pytest.fixture(scope="module")
def corpus_shards(tmp_path_factory) -> Path:
    """Vocab 4096, rows of 129 tokens (parcae-tiny's sizes)."""
    return novel_shards(tmp_path_factory.mktemp("gpu_data"), 4096, 128)
