"""The one exception type of the checkpoint package."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, found, verified or loaded; the message names the file or key."""
