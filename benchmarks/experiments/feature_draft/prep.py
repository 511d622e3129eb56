"""Step 1 of the feature-draft (EAGLE-1) probe: the shipped draft's exact splits, with target features.

Rebuilds the held-out / validation / training records of the shipped SmolLM2 draft from its
cached data (``specdec/drafts/smollm2-135m/.work``, made by the command in its manifest; nothing
is generated when the cache is there), and stores the target's final post-norm hidden state at
every position of the held-out sets, 200 validation records and ``N`` shuffled training records
(``python prep.py N``; the probe used 3000, 10 CPU minutes) in ``$FEATURE_DRAFT_DIR/feats.pt``.
Why post-norm: the target's LM head maps exactly that vector to p, which is what an EAGLE-1
draft regresses and then scores with a head.
"""

import os
import random
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaModel

from specdec.distill.data import distill_data
from specdec.distill.settings import DistillSettings
from specdec.models.loading import load_model

torch.set_num_threads(2)
OUT = Path(os.environ.get("FEATURE_DRAFT_DIR", "/tmp/feature_draft"))
OUT.mkdir(parents=True, exist_ok=True)
s = DistillSettings(
    target="smollm2-135m",
    out=str(Path(__file__).resolve().parents[3] / "specdec/drafts/smollm2-135m"),
    samples=6000,
    greedy_data=True,
    self_prompts=1500,
)
target = load_model(s.target)
split = distill_data(s, target, Path(s.out) / ".work")
train, valid, held = split.train, split.valid, split.held
print({k: len(v) for k, v in held.items()}, len(train), split.greedy_train, len(valid))

cfg = target.config.__class__.from_dict({**target.config.to_dict(), "_attn_implementation": "sdpa"})
body = LlamaModel(cfg)
body.load_state_dict({k[6:]: v for k, v in target.state_dict.items() if k.startswith("model.")}, strict=False)
body.eval()


def feats(recs, desc):
    out = []
    t0 = time.time()
    recs = sorted(recs, key=lambda r: len(r.tokens))
    for i in range(0, len(recs), 16):
        b = recs[i : i + 16]
        w = max(len(r.tokens) for r in b)
        ids = torch.zeros(len(b), w, dtype=torch.long)
        m = torch.zeros(len(b), w, dtype=torch.long)
        for j, r in enumerate(b):
            ids[j, : len(r.tokens)] = torch.tensor(r.tokens)
            m[j, : len(r.tokens)] = 1
        with torch.no_grad():
            h = body(input_ids=ids, attention_mask=m).last_hidden_state
        for j, r in enumerate(b):
            out.append((r, h[j, : len(r.tokens)].to(torch.float16)))
        if i % 320 == 0:
            print(desc, i, len(recs), f"{time.time() - t0:.0f}s", flush=True)
    return out


n_train = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
rng = random.Random(0)
tr = list(train)  # sampled, then greedy continuations
rng.shuffle(tr)
data = {
    "heldout": feats(held["heldout"], "heldout"),
    "heldout_greedy": feats(held["heldout_greedy"], "hg"),
    "self_prompts": feats(held["self_prompts"], "self"),
    "valid": feats(valid[:200], "valid"),
    "train": feats(tr[:n_train], "train"),
}
torch.save(data, str(OUT / "feats.pt"))
print("done")
