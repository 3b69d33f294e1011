"""The engine's error classes: each names what went wrong in words meant for the user."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A model source that cannot be loaded (unknown, missing files, unsupported option)."""
