"""Readers of input documents: text files, JSON lines and parquet, behind one DocumentReader Protocol."""
from __future__ import annotations

from .base import DocumentReader, Record, ReadOptions, open_reader

__all__ = ["DocumentReader", "Record", "ReadOptions", "open_reader"]
