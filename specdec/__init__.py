"""specdec: export and serve ragged, unpadded speculative decoding (EMS-SD, DSBD) for LLaMA models."""

__version__ = "0.1.0"
