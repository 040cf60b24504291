"""Exceptions of the data path. Every message says what was wrong and what to do about it."""
from __future__ import annotations


class DataPrepError(Exception):
    """A problem with the input or the configuration of data preparation or loading."""

    def __init__(self, problem: str, remedy: str = ""):
        self.problem = problem
        self.remedy = remedy
        super().__init__(f"{problem}. What to do: {remedy}" if remedy else problem)


class EmptyCorpusError(DataPrepError):
    """The input directory holds no usable document."""


class TokenizerError(DataPrepError):
    """A tokenizer directory is missing, damaged or does not match what it is used with."""


class TokenizerMismatchError(TokenizerError):
    """The tokenizer's content hash differs from the one recorded in a manifest."""


class NotEnoughTokensError(DataPrepError):
    """A split has too few tokens to fill a single row of seq_len + 1 tokens."""


class CorruptShardError(DataPrepError):
    """A shard is truncated, fails its checksum, or holds a member that cannot be read."""

    def __init__(self, shard: str, problem: str, remedy: str = "", member: str | None = None):
        self.shard = shard
        self.member = member
        where = f"shard {shard}" + (f", member {member}" if member else "")
        super().__init__(f"{where}: {problem}", remedy)


class ResumeStateError(DataPrepError):
    """A saved loader state does not fit the loader it is restored into."""
