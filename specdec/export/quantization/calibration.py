"""The inputs a ``w8a8`` graph's smoothing is calibrated on, and the largest each linear layer's input channels see.

Why chat prompts from the distillation's built-in set: they are in the served format (the chat
template) and none is a benchmark's held-out prompt, so the smoothing is not fitted to what it is
measured on. Both graphs of an export calibrate on the target's tokenizer (a draft ships none):
``W8A8.bind``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from specdec.export.quantization.sources import EMBEDDING

#: chat prompts whose activations calibrate the smoothing (``calibration_ids``)
CALIBRATION_PROMPTS = 64


def calibration_ids(tokenizer: Any | None, vocab_size: int, n: int = CALIBRATION_PROMPTS) -> list[list[int]]:
    """Token sequences to calibrate on: the first ``n`` built-in distillation prompts in the chat template.

    Without a tokenizer (a tiny random model), ``n`` random sequences of 32 ids, seeded: such a
    model's activations have no outlier channels to learn from text.
    """
    if tokenizer is None:
        rng = np.random.default_rng(0)
        return [rng.integers(0, vocab_size, 32).tolist() for _ in range(n)]
    from specdec.distill.prompts import builtin_prompts

    out = []
    for prompt in builtin_prompts()[:n]:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
        else:
            ids = tokenizer(prompt).input_ids
        out.append([int(i) for i in ids])
    return out


def activation_maxima(model: Any, sequences: Sequence[Sequence[int]], names: Sequence[str]) -> dict[str, np.ndarray]:
    """The largest ``|input|`` of each input channel of the linear layers ``names`` (weight names) over ``sequences``.

    Runs the transformers twin of ``model`` (``LoadedModel.to_hf``) with a hook on each layer. The
    embedding table's name stands for the LM head it is tied to (``sources.linear_names``): its inputs
    are the head's.
    """
    import torch

    hf = model.to_hf()
    modules = dict(hf.named_modules())
    maxima: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Any:
        def record(_module: Any, inputs: tuple[Any, ...]) -> None:
            seen = inputs[0].detach().abs().reshape(-1, inputs[0].shape[-1]).amax(dim=0).float()
            maxima[name] = seen if name not in maxima else torch.maximum(maxima[name], seen)

        return record

    def module(name: str) -> Any:
        return modules["lm_head" if name == EMBEDDING else name.removesuffix(".weight")]

    handles = [module(name).register_forward_pre_hook(hook(name)) for name in names]
    try:
        with torch.no_grad():
            for ids in sequences:
                hf(torch.tensor([list(ids)], dtype=torch.long))
    finally:
        for handle in handles:
            handle.remove()
    return {name: maxima[name].numpy() for name in names}
