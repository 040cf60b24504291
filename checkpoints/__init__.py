"""Sharded zarr v3 checkpoints: save (snapshot, plan, background write, commit), load (find, verify, read).

Public API: :class:`Piece`, :class:`Checkpointer`, :class:`SaveResult`, :func:`wait_committed`,
:func:`find_checkpoints`, :class:`CheckpointReader`, :class:`ArrayInfo`, :func:`open_newest_valid`,
:class:`CheckpointError`, :class:`CorruptCheckpointError`. Command line: ``python -m checkpoints --help``.
"""
from .errors import CheckpointError, CorruptCheckpointError
from .load import ArrayInfo, CheckpointReader, find_checkpoints, open_newest_valid
from .pieces import Piece
from .save import Checkpointer, SaveResult, wait_committed

__all__ = ["ArrayInfo", "CheckpointError", "CheckpointReader", "Checkpointer", "CorruptCheckpointError", "Piece",
           "SaveResult", "find_checkpoints", "open_newest_valid", "wait_committed"]
