"""The inputs a quantized graph is calibrated on, and what each linear layer's input channels see there.

Two schemes calibrate: a ``w8a8`` chain's smoothing (on the channels' largest inputs) and calibrated
rounding (``rounding``, on their second moments). Why chat prompts from the distillation's built-in
set: they are in the served format (the chat template) and none is a benchmark's held-out prompt, so
neither is fitted to what it is measured on. Both graphs of an export calibrate on the target's
tokenizer (a draft ships none): the strategies' ``bind``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from specdec.export.quantization.sources import EMBEDDING

#: chat prompts whose activations calibrate (``calibration_ids``)
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
    """The largest ``|input|`` of each input channel of the linear layers ``names`` (weight names) over ``sequences``:
    what a ``w8a8`` chain's smoothing balances."""
    return _input_statistics(model, sequences, names, second_moment=False)


def activation_moments(model: Any, sequences: Sequence[Sequence[int]], names: Sequence[str]) -> dict[str, np.ndarray]:
    """The mean ``input**2`` of each input channel of the linear layers ``names`` over every token of ``sequences``:
    how much an error in each column of the weight costs the layer's output (``rounding``)."""
    return _input_statistics(model, sequences, names, second_moment=True)


def _input_statistics(
    model: Any, sequences: Sequence[Sequence[int]], names: Sequence[str], second_moment: bool
) -> dict[str, np.ndarray]:
    """Per input channel of each linear layer of ``names``: the mean square (``second_moment``) or the largest
    magnitude of its inputs.

    Runs the transformers twin of ``model`` (``LoadedModel.to_hf``) with a hook on each layer. The
    embedding table's name stands for the LM head it is tied to (``sources.linear_names``): its inputs
    are the head's.
    """
    import torch

    hf = model.to_hf()
    modules = dict(hf.named_modules())
    seen: dict[str, torch.Tensor] = {}
    tokens = 0

    def hook(name: str) -> Any:
        def record(_module: Any, inputs: tuple[Any, ...]) -> None:
            rows = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
            if second_moment:
                seen[name] = (rows * rows).sum(dim=0) + seen.get(name, 0.0)
            else:
                top = rows.abs().amax(dim=0)
                seen[name] = top if name not in seen else torch.maximum(seen[name], top)

        return record

    def module(name: str) -> Any:
        return modules["lm_head" if name == EMBEDDING else name.removesuffix(".weight")]

    handles = [module(name).register_forward_pre_hook(hook(name)) for name in names]
    try:
        with torch.no_grad():
            for ids in sequences:
                hf(torch.tensor([list(ids)], dtype=torch.long))
                tokens += len(ids)
    finally:
        for handle in handles:
            handle.remove()
    return {name: (seen[name] / tokens if second_moment else seen[name]).numpy() for name in names}
