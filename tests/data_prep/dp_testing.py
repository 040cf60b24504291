"""Constants and helpers shared by the data_prep tests (a uniquely named module, imported by the test files)."""
from __future__ import annotations

SMALL_CORPUS_FILES = 24
TOKENIZER_VOCAB = 4096
SEQ_LEN = 64
ROWS_PER_SHARD = 300
