"""The draft: its head tokens, its initialisation from the target (or a finished draft), and its trainable module.

Why this shape: ``--layers`` LLaMA layers of the target's width initialised from target layers
(first and last, evenly spaced in between) and the target's final norm start close to the
target; the target's embeddings are reused (not trained, not stored); and an LM head restricted
to the ``--head-size`` tokens most frequent in the data costs a fraction of a full head (tokens
outside it get q = 0, so verification stays lossless). ``--share-head`` makes the head the
target's own rows (frozen, not stored); ``--init-from`` grows a finished draft by new layers
that start as exact no-ops (see :func:`init_draft`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from specdec.distill.records import Record
from specdec.models.loading import LoadedModel


def select_head(
    records: Sequence[Record],
    size: int,
    vocab_size: int,
    always: Sequence[int] = (),
    within: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``size`` most frequent tokens of the data (teacher top-1s and sampled tokens), plus ``always``.

    ``within``: choose among these tokens only (a grown draft's smaller head is part of its source's).
    """
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for r in records:
        counts.index_add_(
            0, torch.as_tensor(r.tokens, dtype=torch.long), torch.ones(len(r.tokens), dtype=torch.float64)
        )
        counts.index_add_(0, r.top_ids[:, 0].long(), torch.ones(len(r.positions), dtype=torch.float64))
    for t in always:
        counts[t] = math.inf
    if within is not None:
        outside = torch.ones(vocab_size, dtype=torch.bool)
        outside[within] = False
        counts[outside] = -math.inf
        size = min(size, len(within))
    size = min(size, vocab_size)
    return torch.sort(torch.topk(counts, size).indices).values


def init_draft(
    target: LoadedModel,
    layers: int,
    head_ids: torch.Tensor,
    *,
    share_head: bool = False,
    grow: LoadedModel | None = None,
) -> LoadedModel:
    """``layers`` target layers (first, last and evenly spaced), the target's norm and embeddings, a head of rows.

    ``share_head``: the head *is* the target's LM head restricted to ``head_ids``, frozen, so it
    is not stored: the bytes it would take buy another layer under a size budget.
    ``grow``: start from a finished draft instead (``--init-from``): its layers become the first
    ones and the last, and each new layer sits just before its last, initialised from a target
    layer with its two output projections (``o_proj``, ``down_proj``) at zero. A zero output
    adds nothing to the residual stream, so the grown draft computes exactly what the finished
    one did (with its own head, or the rows of a subset of it) and training starts where that
    one stopped, not from scratch. A smaller head pays for the new layer's bytes and compute.
    """
    from specdec.models.loading import restrict_head

    n = int(target.config.num_hidden_layers)
    if not 1 <= layers <= n:
        raise ValueError(f"--layers must be between 1 and {n} (the target's layers), got {layers}")
    picked = [round(i * (n - 1) / (layers - 1)) for i in range(layers)] if layers > 1 else [0]
    restricted = restrict_head(target, head_ids)  # checks the ids; stores them ascending
    assert restricted.head_token_ids is not None  # restrict_head always sets them
    head_ids = restricted.head_token_ids
    old = int(grow.config.num_hidden_layers) if grow is not None else 0
    if grow is not None:
        check_growable(old, layers)
    # slot -> (source state dict, source layer, new?): the grown draft's layers keep their order
    sources = [(target.state_dict, picked[i], False) for i in range(layers)]
    if grow is not None:
        sources[: old - 1] = [(grow.state_dict, i, False) for i in range(old - 1)]
        sources[old - 1 : layers - 1] = [(target.state_dict, picked[i], True) for i in range(old - 1, layers - 1)]
        sources[layers - 1] = (grow.state_dict, old - 1, False)
    sd: dict[str, torch.Tensor] = {}
    for new, (source, layer, silent) in enumerate(sources):
        prefix = f"model.layers.{layer}."
        for name, tensor in source.items():
            if name.startswith(prefix):
                copy = tensor.detach().clone().float()
                if silent and name.endswith(("o_proj.weight", "down_proj.weight")):
                    copy.zero_()
                sd[f"model.layers.{new}." + name[len(prefix) :]] = copy
    sd["model.norm.weight"] = (grow or target).state_dict["model.norm.weight"].detach().clone().float()
    sd["model.embed_tokens.weight"] = target.state_dict["model.embed_tokens.weight"]  # shared, frozen
    if grow is not None and not share_head:  # its trained rows (of a subset of its tokens, for a smaller head)
        head = restrict_head(grow, head_ids).state_dict["lm_head.weight"].float()
    else:
        head = restricted.state_dict["lm_head.weight"].float()
    config = target.config.__class__.from_dict(
        {**target.config.to_dict(), "num_hidden_layers": layers, "tie_word_embeddings": False}
    )
    extra = {
        "init_layers": picked
        if grow is None
        else [f"draft {layer}" if source is grow.state_dict else layer for source, layer, _ in sources],
        "head_token_ids": head_ids,
        "shared_head": share_head,
    }
    return LoadedModel(
        f"{target.name}-draft",
        config,
        {**sd, "lm_head.weight": head},
        target.tokenizer,
        f"distilled from {target.name}",
        extra,
    )


def check_growable(old: int, layers: int) -> None:
    """Refuse to "grow" a draft of ``old`` layers into fewer: its layers could not all be kept."""
    if not 1 <= old <= layers:
        raise ValueError(f"--init-from has {old} layers: it can only grow to as many or more, not {layers}")


class DraftNet(torch.nn.Module):
    """The draft as a trainable module: HF LLaMA layers over frozen target embeddings, a head of K rows."""

    head_ids: torch.Tensor  # a buffer: the target ids of the head's rows

    def __init__(self, draft: LoadedModel) -> None:
        super().__init__()
        from transformers import LlamaModel

        config = draft.config.__class__.from_dict({**draft.config.to_dict(), "_attn_implementation": "sdpa"})
        self.model = LlamaModel(config)
        own = {k[len("model.") :]: v for k, v in draft.state_dict.items() if k.startswith("model.")}
        missing, unexpected = self.model.load_state_dict(own, strict=False)
        if unexpected or [m for m in missing if "rotary" not in m]:
            raise ValueError(f"draft weights do not fit: missing={missing} unexpected={unexpected}")
        self.model.embed_tokens.weight.requires_grad_(False)
        self.head = torch.nn.Parameter(
            draft.state_dict["lm_head.weight"].detach().clone().float(),
            requires_grad=not draft.extra.get("shared_head", False),
        )
        if draft.head_token_ids is None:
            raise ValueError(f"{draft.name}: a draft to train has a restricted head (head_token_ids), this one none")
        self.register_buffer("head_ids", draft.head_token_ids.clone())

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return hidden @ self.head.t()

    def export(self, template: LoadedModel) -> LoadedModel:
        """Back to a ``LoadedModel`` (trained weights, embeddings still the target's tensor)."""
        sd = {f"model.{k}": v.detach().clone() for k, v in self.model.state_dict().items() if "rotary" not in k}
        sd["model.embed_tokens.weight"] = template.state_dict["model.embed_tokens.weight"]
        sd["lm_head.weight"] = self.head.detach().clone()
        return LoadedModel(
            template.name, template.config, sd, template.tokenizer, template.source, dict(template.extra)
        )
