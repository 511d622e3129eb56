"""What the probe's two trainings share, so that they differ only in the draft they train."""

import torch

from specdec.distill.objective import lr_factor


def optimizer_step(opt: torch.optim.Optimizer, net: torch.nn.Module, loss: torch.Tensor, step: int, total: int) -> None:
    """One AdamW step at distill's schedule (lr 1e-3, 100 warm-up steps, cosine to 10% over ``total``)."""
    for group in opt.param_groups:
        group["lr"] = 1e-3 * lr_factor(step, step / total, 100)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()
