"""The document structure of packed rows, for document-aware attention (model.doc_mask).

A packed row holds several documents, each framed BOS text EOS. With doc_mask a new document starts at every BOS
token of a row, and the tokens before a row's first BOS (the tail of a document cut at the row start) form a
document of their own. Each token then attends only to the earlier tokens of its own document, and its rotary
position counts from 0 at its document's start, so a document packed anywhere in a row computes what it computes
alone in a row of its own.

The structure is derived from the token ids alone (no extra data), once per micro-batch, and carried with the rows:
a :class:`Documents` is what the blocks take in place of the RoPE tables. It holds, for its rows, the per-token
rotary tables (gathered at the within-document positions) and what the attention kernel needs:
  - dense kernels (sdpa, math): a block-causal boolean mask [B, 1, S, S] (True: the query may attend the key);
  - varlen kernels (flash-attn's varlen functions, Transformer Engine's "thd" layout): the cumulative document
    lengths over the flattened [B * S] tokens (cu_seqlens, int32 on the device) and the longest document, a host
    integer, so that no kernel call reads the device.
The ragged loop runs a permuted order of the rows (`take`) and, in each lap, a prefix of it (`head`): both return
the same structure for those rows without recomputing it per lap (a prefix is a view; a permutation gathers the
rows once per micro-batch). Activation checkpointing recomputes with the very same object, so with the same mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from megaloop.model.transfer import to_device

KERNELS = ("dense", "varlen")


def document_starts(input_ids: torch.Tensor, bos_id: int) -> torch.Tensor:
    """[B, S] bool: True where a document starts (every BOS token, and the first token of each row)."""
    starts = input_ids == bos_id
    starts[:, 0] = True
    return starts


def positions_and_segments(starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(position of each token within its document, index of its document within the row), both [B, S] int64."""
    index = torch.arange(starts.shape[1], device=starts.device).expand_as(starts)
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first, starts.long().cumsum(dim=1) - 1


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool: query i may attend key j when both are in one document and j <= i."""
    s = segments.shape[1]
    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril()
    return (same & causal).unsqueeze(1)


def document_lengths(starts: np.ndarray) -> np.ndarray:
    """The lengths of the documents of host rows [B, S] (bool starts), row by row, in order."""
    begins = np.flatnonzero(starts.reshape(-1))
    return np.diff(np.append(begins, starts.size))


def attention_share(input_ids: np.ndarray, bos_id: int) -> float:
    """The share of a full causal row's query-key pairs that document masking keeps: the mean over rows of
    sum_d len_d^2 / S^2 for rows [B, S] of token ids (1.0: one document per row). The FLOP model scales its
    attention terms by it (megaloop.train.flops)."""
    ids = np.asarray(input_ids)
    starts = ids == bos_id
    starts[:, 0] = True
    lengths = document_lengths(starts).astype(np.float64)
    return float((lengths ** 2).sum() / (ids.shape[0] * ids.shape[1] ** 2))


@dataclass(frozen=True, eq=False)
class VarlenRows:
    """What flash-attn's varlen functions and TE's "thd" layout take for a block of rows: cu_seqlens (int32 on the
    device, [documents + 1], offsets into the flattened rows), the documents per row (host, cumulative [B + 1]) and
    the document lengths (host), from which max_len and any prefix of rows follow without reading the device."""

    cu_seqlens: torch.Tensor
    row_docs: np.ndarray
    lengths: np.ndarray

    @staticmethod
    def of(host_starts: np.ndarray, device: torch.device) -> "VarlenRows":
        lengths = document_lengths(host_starts)
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        row_docs = np.concatenate([[0], np.cumsum(host_starts.sum(axis=1))]).astype(np.int64)
        return VarlenRows(to_device(cu, device), row_docs, lengths)

    @property
    def max_len(self) -> int:
        return int(self.lengths.max()) if self.lengths.size else 0

    def head(self, rows: int) -> "VarlenRows":
        docs = int(self.row_docs[rows])
        return VarlenRows(self.cu_seqlens[:docs + 1], self.row_docs[:rows + 1], self.lengths[:docs])


@dataclass(frozen=True, eq=False)
class Documents:
    """The document structure of a block of rows (see the module docstring): starts and segments [B, S], the
    rotary tables cos/sin gathered per token [B, S, head_dim / 2], the kernel's aid (mask for "dense", varlen for
    "varlen") and the rows' starts on the host where the varlen aid needs them."""

    starts: torch.Tensor
    segments: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    mask: Optional[torch.Tensor] = None
    varlen: Optional[VarlenRows] = None
    host_starts: Optional[np.ndarray] = None

    @staticmethod
    def build(input_ids: torch.Tensor, bos_id: int, tables: tuple[torch.Tensor, torch.Tensor],
              kernel: str = "dense") -> "Documents":
        """The structure of rows `input_ids` [B, S] with document starts at `bos_id`; `tables` the model's RoPE
        tables (cos, sin) [seq_len, head_dim / 2]; `kernel` "dense" or "varlen" (which aid to build). The varlen
        aid reads the starts once from the device (one transfer per micro-batch)."""
        if kernel not in KERNELS:
            raise ValueError(f"unknown document kernel {kernel!r}; use one of {KERNELS}")
        starts = document_starts(input_ids, bos_id)
        return Documents.from_starts(starts, tables, kernel, starts.cpu().numpy() if kernel == "varlen" else None)

    @staticmethod
    def from_starts(starts: torch.Tensor, tables, kernel: str, host_starts: Optional[np.ndarray]) -> "Documents":
        positions, segments = positions_and_segments(starts)
        cos, sin = tables
        if kernel == "dense":
            return Documents(starts, segments, cos[positions], sin[positions], mask=block_causal_mask(segments))
        return Documents(starts, segments, cos[positions], sin[positions],
                         varlen=VarlenRows.of(host_starts, starts.device), host_starts=host_starts)

    @property
    def rows(self) -> int:
        return self.starts.shape[0]

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token rotary tables (cos, sin) [B, S, head_dim / 2]."""
        return self.cos, self.sin

    def head(self, rows: int) -> "Documents":
        """The first `rows` rows (views; no computation)."""
        if rows == self.rows:
            return self
        return Documents(self.starts[:rows], self.segments[:rows], self.cos[:rows], self.sin[:rows],
                         None if self.mask is None else self.mask[:rows],
                         None if self.varlen is None else self.varlen.head(rows),
                         None if self.host_starts is None else self.host_starts[:rows])

    def take(self, order: np.ndarray) -> "Documents":
        """The rows in host order `order` (gathered once; the varlen aid rebuilt from the host starts)."""
        index = to_device(np.asarray(order, dtype=np.int64), self.starts.device)
        pick = [t.index_select(0, index) for t in (self.starts, self.segments, self.cos, self.sin)]
        mask = None if self.mask is None else self.mask.index_select(0, index)
        host = None if self.host_starts is None else self.host_starts[np.asarray(order)]
        varlen = None if host is None else VarlenRows.of(host, self.starts.device)
        return Documents(*pick, mask=mask, varlen=varlen, host_starts=host)

    def dense_mask(self) -> torch.Tensor:
        """The block-causal mask: the one built for a dense kernel, or made now (a varlen structure whose call
        falls back to sdpa)."""
        return self.mask if self.mask is not None else block_causal_mask(self.segments)

    def varlen_rows(self) -> VarlenRows:
        """The varlen aid: the one built, or made now from the starts (one read of the device)."""
        if self.varlen is not None:
            return self.varlen
        host = self.host_starts if self.host_starts is not None else self.starts.cpu().numpy()
        return VarlenRows.of(host, self.starts.device)
