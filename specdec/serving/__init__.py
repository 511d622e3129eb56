"""Serving specdec through a real Triton Inference Server (launcher in :mod:`specdec.serving.server`)."""
