"""The OpenAI-compatible HTTP frontend: ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` over the
served Triton endpoint (docs/openai.md).

A thin, stateless translator: each HTTP request becomes one gRPC stream to ``specdec_stream`` and its responses
become OpenAI's JSON (or its server-sent events). No tokenizer and no engine live here; the server's
preprocessing and postprocessing models do the tokenizing, so what an OpenAI client gets is what a gRPC client
gets. ``python -m specdec.serving.openai`` runs it; ``specdec serve`` starts it beside tritonserver
(``specdec.serving.openai.process``). Nothing is imported here, so the launcher stays light.
"""
