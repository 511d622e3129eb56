"""What training minimises, how fast it steps, and how a draft is scored.

Why: the loss is the cross-entropy to the teacher restricted to the head, i.e. KL(target ‖ draft)
on the head up to a constant, on every generated position; the same loss on validation records
picks the checkpoint to keep. The reported metrics are measured on held-out continuations with
the *full* target distribution: greedy agreement (argmax q = argmax p) and expected acceptance
Σ min(p, q) at temperature 1, on the sampled continuations and, separately, on the greedy ones
(the contexts greedy speculation meets).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from specdec.distill.net import DraftNet
from specdec.distill.records import Record
from specdec.models.loading import LoadedModel


def teacher_batch(
    records: Sequence[Record], head_ids: torch.Tensor, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded inputs, mask, and the teacher as (row, head column, prob) triples over the head."""
    width = max(len(r.tokens) for r in records)
    input_ids = torch.zeros(len(records), width, dtype=torch.long)
    mask = torch.zeros(len(records), width, dtype=torch.long)
    column = torch.full((vocab_size,), -1, dtype=torch.long)
    column[head_ids] = torch.arange(len(head_ids))
    rows, cols, probs = [], [], []
    for b, r in enumerate(records):
        input_ids[b, : len(r.tokens)] = torch.as_tensor(r.tokens)
        mask[b, : len(r.tokens)] = 1
        pos = torch.as_tensor(r.positions, dtype=torch.long)
        head_col = column[r.top_ids.long()]  # [P, k]
        p = torch.exp(r.top_logp.float()) * (head_col >= 0)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)  # the teacher on the head, renormalised
        flat_row = (b * width + pos - 1).unsqueeze(1).expand_as(head_col)
        keep = head_col >= 0
        rows.append(flat_row[keep])
        cols.append(head_col[keep])
        probs.append(p[keep])
    return input_ids, mask, torch.cat(rows), torch.cat(cols), torch.cat(probs)


def head_cross_entropy(net: DraftNet, records: Sequence[Record], vocab_size: int) -> tuple[torch.Tensor, int]:
    input_ids, mask, rows, cols, probs = teacher_batch(records, net.head_ids, vocab_size)
    logq = torch.log_softmax(net(input_ids, mask).float(), dim=-1).reshape(-1, len(net.head_ids))
    positions = sum(len(r.positions) for r in records)
    return -(probs * logq[rows, cols]).sum() / positions, positions


def distill_loss(net: DraftNet, records: Sequence[Record], vocab_size: int) -> tuple[torch.Tensor, int]:
    """Cross-entropy of the draft to the head-restricted teacher, averaged over teacher positions."""
    return head_cross_entropy(net, records, vocab_size)


@torch.no_grad()
def validation_loss(net: DraftNet, records: Sequence[Record], vocab_size: int, batch: int = 8) -> float:
    """The training objective on records never trained on: picks the best checkpoint, not a metric to report."""
    was_training = net.training
    net.eval()
    total = count = 0.0
    for i in range(0, len(records), batch):
        loss, positions = head_cross_entropy(net, records[i : i + batch], vocab_size)
        total += float(loss) * positions
        count += positions
    net.train(was_training)
    return total / max(count, 1)


def lr_factor(step: int, progress: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% at the end of the budget (``progress`` in [0, 1]).

    Why: a constant rate leaves the weights noisy at the end of a short CPU budget; decaying by
    the fraction of the budget used (time or steps) keeps the schedule resumable.
    """
    warm = min(1.0, (step + 1) / max(warmup, 1))
    return warm * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0))))


@torch.no_grad()
def evaluate(net: DraftNet, target: LoadedModel, records: Sequence[Record]) -> dict[str, float]:
    """Greedy agreement and expected acceptance Σ min(p, q) against the FULL target distribution."""
    from specdec.runtime.backends.torch_backend import TorchBackend
    from specdec.runtime.packed import SeqWork, pack

    backend = TorchBackend(target)
    vocab = target.vocab_size
    agree = accept = kl = 0.0
    count = 0
    for r in records:
        cache = backend.allocate_cache(1, len(r.tokens) + 1)
        p_all = torch.softmax(torch.as_tensor(backend.step(pack([SeqWork(0, 0, r.tokens, logits="all")]), cache)), -1)
        q_head = torch.softmax(
            net(torch.as_tensor([r.tokens]), torch.ones(1, len(r.tokens), dtype=torch.long))[0].float(), -1
        )
        pos = torch.as_tensor(r.positions, dtype=torch.long) - 1
        p = p_all[pos]
        q = torch.zeros(len(pos), vocab)
        q[:, net.head_ids] = q_head[pos]
        agree += float((q.argmax(-1) == p.argmax(-1)).sum())
        accept += float(torch.minimum(p, q).sum())
        p_head = p[:, net.head_ids]
        p_head = p_head / p_head.sum(-1, keepdim=True)
        kl += float((p_head * (torch.log(p_head.clamp_min(1e-12)) - torch.log(q_head[pos].clamp_min(1e-12)))).sum())
        count += len(pos)
    n = max(count, 1)
    return {"greedy_agreement": agree / n, "expected_acceptance": accept / n, "kl_on_head": kl / n, "positions": count}
