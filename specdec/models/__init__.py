"""Model artifacts, below the runtime: what a model is, where it comes from, and what an export holds.

``loading`` resolves presets, Hugging Face directories, GGUF files and tiny random models into a
``LoadedModel``; ``manifest`` reads and verifies an export directory's manifest; ``drafts``
finds, loads and saves draft models and checks a draft against its target. Everything above
(``runtime``, ``export``, ``serving``, ``distill``, the CLI) reads models through here, and
nothing here imports them.
"""
