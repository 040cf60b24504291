"""Errors raised while reading or writing checkpoints.

Every message is one line: what was wrong, then what to do about it. ``CorruptCheckpointError`` means the files on
disk do not match what the writer recorded (checksum, size, missing or unexpected file); plain
``CheckpointError`` means the directory is not a checkpoint this code accepts (wrong format, refused content).
"""


class CheckpointError(Exception):
    """A directory that is not a loadable checkpoint, or content that is refused (e.g. not what our writer makes)."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint whose files differ from its manifest: bytes flipped, truncated, missing or extra."""
