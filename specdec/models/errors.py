"""The errors of the model layer, in a module without torch so the runtime can raise and catch them anywhere."""

from __future__ import annotations


class ModelResolutionError(ValueError):
    """A model spec cannot be turned into weights; the message says what to pass instead."""


class DraftMismatchError(ValueError):
    """The draft model cannot propose tokens for this target (different vocabulary)."""


class DraftLoadError(ValueError):
    """A distilled draft directory is incomplete, corrupt, or was made for another target."""
