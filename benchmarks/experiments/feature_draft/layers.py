"""Step 2, baseline: the shipped architecture trained for the same steps on the same batches.

``python layers.py STEPS``: ``init_draft`` with 2 target layers (0 and 29) and an 8192-row head
chosen from the same training records, ``DraftNet``'s loss, the same schedule and batches as
``eagle.py``, scored with ``specdec.distill.objective.evaluate`` on the same held-out sets.
"""

import os
import random
import sys
import time
from pathlib import Path

import torch
from common import optimizer_step

from specdec.distill.net import DraftNet, init_draft, select_head
from specdec.distill.objective import evaluate, head_cross_entropy
from specdec.models.loading import load_model

torch.set_num_threads(1)
OUT = Path(os.environ.get("FEATURE_DRAFT_DIR", "/tmp/feature_draft"))
OUT.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
steps_total = int(sys.argv[1])
data = torch.load(str(OUT / "feats.pt"), weights_only=False)
target = load_model("smollm2-135m")
train = [r for r, _ in data["train"]]
head_ids = select_head(train, 8192, target.vocab_size, target.eos_token_ids)
net = DraftNet(init_draft(target, 2, head_ids))
opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
rng = random.Random(0)
t0 = time.time()
for step in range(steps_total):
    loss, _ = head_cross_entropy(net, rng.sample(train, 8), target.vocab_size)
    optimizer_step(opt, net, loss, step, steps_total)
    if step % 200 == 0:
        print(f"step {step} {time.time() - t0:.0f}s ce {loss.item():.3f}", flush=True)
print("base2 steps", steps_total, "seconds", round(time.time() - t0))
net.eval()
for name in ("heldout", "heldout_greedy", "self_prompts"):
    m = evaluate(net, target, [r for r, _ in data[name]])
    print("base2", name, round(m["greedy_agreement"], 4), round(m["expected_acceptance"], 4))
