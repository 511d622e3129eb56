"""The Python-backend models of the repository, by the names every written ``model.py`` imports them from.

Thin adapters: tensors in, ``serving.inputs`` validates, ``EngineService`` decodes, ``runtime.text`` decides the
text; nothing here decodes or samples. Each lives in a module of its own concern:

- ``Preprocessing`` and ``Postprocessing`` (``text_models``): the tokenizer's two stateless models;
- ``EngineModel`` (``engine_model``, decoupled): the engine and its decoding loops;
- ``UnaryModel`` (``specdec``) and ``StreamModel`` (``specdec_stream``) (``entry_points``): what clients call;
- ``ReadinessGate`` (``specdec_ready``, ``gate_model``): the server's readiness.

Why this module stays: repositories written by earlier versions import the classes from here.
"""

from __future__ import annotations

from specdec.serving.engine_model import EngineModel
from specdec.serving.entry_points import StreamModel, UnaryModel
from specdec.serving.gate_model import ReadinessGate
from specdec.serving.text_models import Postprocessing, Preprocessing

__all__ = ["EngineModel", "Postprocessing", "Preprocessing", "ReadinessGate", "StreamModel", "UnaryModel"]
