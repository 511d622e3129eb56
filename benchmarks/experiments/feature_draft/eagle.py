"""Step 2: train and score a feature draft (EAGLE-1) on ``feats.pt``.

``python eagle.py STEPS W_REG INIT_LAYER TAG [train|frozen] [sum|feat]``: one LLaMA layer
(initialised from target layer ``INIT_LAYER``) over ``fc([token embedding, previous target
feature])``, a final RMSNorm, an 8192-row head started from the target's embedding rows; loss
= cross-entropy to the teacher's top-32 on the head + ``W_REG`` x smooth-L1 to the target's
feature. ``sum`` starts ``fc`` as embedding + feature, ``feat`` as the feature alone.

Scores, against the full target distribution, greedy agreement and Σ min(p, q) at depth 1
(every position fed the target's true previous feature: the first draft token after a
verification) and depth 2 (fed the draft's own predicted feature: the second draft token).
A LLaMA-layer draft has no such split: its teacher-forced score holds at every depth.
Training batches are the same as ``layers.py``'s (same seed, same record order).
"""

import os
import random
import sys
import time
from pathlib import Path

import torch
from common import optimizer_step
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from specdec.distill.net import select_head
from specdec.distill.objective import teacher_batch
from specdec.models.loading import load_model

torch.set_num_threads(1)
OUT = Path(os.environ.get("FEATURE_DRAFT_DIR", "/tmp/feature_draft"))
OUT.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
steps_total = int(sys.argv[1])
w_reg = float(sys.argv[2])
init_layer = int(sys.argv[3])
tag = sys.argv[4]
FC_INIT = sys.argv[6] if len(sys.argv) > 6 else "sum"
train_head = len(sys.argv) <= 5 or sys.argv[5] != "frozen"
data = torch.load(str(OUT / "feats.pt"), weights_only=False)
target = load_model("smollm2-135m")
cfg = target.config.__class__.from_dict({**target.config.to_dict(), "_attn_implementation": "sdpa"})
V, H = target.vocab_size, cfg.hidden_size
emb_w = target.state_dict["model.embed_tokens.weight"].float()
head_ids = select_head([r for r, _ in data["train"]], 8192, V, target.eos_token_ids)


class Eagle(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2 * H, H, bias=False)
        with torch.no_grad():  # start as "feature passes through" + embedding
            self.fc.weight.zero_()
            self.fc.weight[:, H:] = torch.eye(H)
            if FC_INIT == "sum":
                self.fc.weight[:, :H] = torch.eye(H)
        self.layer = LlamaDecoderLayer(cfg, layer_idx=0)
        sd = {
            k[len(f"model.layers.{init_layer}.") :]: v
            for k, v in target.state_dict.items()
            if k.startswith(f"model.layers.{init_layer}.")
        }
        self.layer.load_state_dict(sd)
        self.rotary = LlamaRotaryEmbedding(cfg)
        self.head = torch.nn.Parameter(emb_w[head_ids].clone(), requires_grad=train_head)
        self.norm_w = torch.nn.Parameter(target.state_dict["model.norm.weight"].float().clone())

    def forward(self, ids, feat, mask):
        x = self.fc(torch.cat([emb_w[ids], feat], -1))
        T = ids.shape[1]
        pos = torch.arange(T).unsqueeze(0).expand(ids.shape[0], -1)
        pe = self.rotary(x, pos)
        causal = torch.full((T, T), float("-inf")).triu(1)
        am = causal[None, None] + torch.where(mask[:, None, None, :] > 0, 0.0, float("-inf"))
        out = self.layer(x, attention_mask=am, position_ids=pos, position_embeddings=pe)
        out = out[0] if isinstance(out, tuple) else out
        var = out.pow(2).mean(-1, keepdim=True)
        normed = out * torch.rsqrt(var + 1e-5) * self.norm_w  # regress the normed output to the post-norm feature
        return normed, normed @ self.head.t()


def batch(items):
    """distill's padded batch and head-restricted teacher, plus each position's previous and own target feature."""
    ids, mask, rows, cols, probs = teacher_batch([r for r, _ in items], head_ids, V)
    feat_in = torch.zeros(*ids.shape, H)
    feat_tgt = torch.zeros(*ids.shape, H)
    for b, (r, f) in enumerate(items):
        n = len(r.tokens)
        feat_in[b, 1:n] = f[: n - 1].float()
        feat_tgt[b, :n] = f.float()
    return ids, mask, feat_in, feat_tgt, rows, cols, probs


net = Eagle()
opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
train = data["train"]
rng = random.Random(0)
t0 = time.time()
step = 0
while step < steps_total:
    items = rng.sample(train, 8)
    ids, mask, fi, ft, rows, cols, probs = batch(items)
    fi = fi + (torch.rand_like(fi) - 0.5) * 0.2 * (fi != 0)  # EAGLE's feature noise
    normed, logits = net(ids, fi, mask)
    logq = torch.log_softmax(logits, -1).reshape(-1, len(head_ids))
    n_pos = sum(len(r.positions) for r, _ in items)
    ce = -(probs * logq[rows, cols]).sum() / n_pos
    m = mask.bool()
    reg = torch.nn.functional.smooth_l1_loss(normed[m], ft[m])
    loss = ce + w_reg * reg
    optimizer_step(opt, net, loss, step, steps_total)
    if step % 200 == 0:
        print(f"step {step} {time.time() - t0:.0f}s ce {ce.item():.3f} reg {reg.item():.4f}", flush=True)
    step += 1

# eval: p from target head on true features (teacher-forced), depth 1 (true features) and depth 2 (draft's own)


@torch.no_grad()
def evaluate(items):
    net.eval()
    res = {"d1": [0, 0], "d2": [0, 0]}
    n = 0
    for r, f in items:
        f = f.float()
        T = len(r.tokens)
        ids = torch.tensor([r.tokens])
        mask = torch.ones(1, T)
        fin = torch.zeros(1, T, H)
        fin[0, 1:] = f[:-1]
        o1, l1 = net(ids, fin, mask)
        fin2 = torch.zeros(1, T, H)
        fin2[0, 1:] = o1[0, :-1]
        _, l2 = net(ids, fin2, mask)
        pos = torch.tensor(r.positions) - 1
        p = torch.softmax(f[pos] @ emb_w.t(), -1)
        for key, logits_d in (("d1", l1), ("d2", l2)):
            q = torch.zeros(len(pos), V)
            q[:, head_ids] = torch.softmax(logits_d[0, pos], -1)
            res[key][0] += float((q.argmax(-1) == p.argmax(-1)).sum())
            res[key][1] += float(torch.minimum(p, q).sum())
        n += len(pos)
    return {k: (round(a / n, 4), round(b / n, 4)) for k, (a, b) in res.items()}, n


print(tag, "steps", step, "seconds", round(time.time() - t0))
for name in ("heldout", "heldout_greedy", "self_prompts"):
    print(tag, name, evaluate(data[name]))
torch.save(net.state_dict(), OUT / f"{tag}.pt")
