"""Is DSBD's quality that of beam sampling, with fixed and with adaptive γ? More samples than ``bench beams``.

Why: ``specdec bench beams`` scores 4 requests once, so its log-likelihood column moves by a few
tenths between points of the same law (beam W=3 and W=4 there differ by 0.18 in the wrong
direction). Per output slot, DSBD draws from the same law as i.i.d. beam sampling whatever γ
is (``tests/test_beams.py``); this measures the answers' mean target log-likelihood per token
over 16 extractive prompts x 2 seeds per method, with its standard error, so a real loss of
quality would show.

Run::

    python benchmarks/experiments/dsbd_quality.py 2 3      # beam widths (W = W_S)
"""

from __future__ import annotations

import statistics
import sys

import torch

from specdec.bench.workloads import build_workload
from specdec.models.drafts import load_pair
from specdec.runtime.backends.torch_backend import TorchBackend
from specdec.runtime.beams import continuation_logprob
from specdec.runtime.config import EngineConfig
from specdec.runtime.draft_length import DraftLength
from specdec.runtime.drafters import ModelDrafter
from specdec.runtime.engine import Engine
from specdec.runtime.request import BeamParams


def main(widths: list[int]) -> None:
    torch.set_num_threads(2)
    target, draft = load_pair("smollm2-135m", "smollm2-135m-draft")
    scorer = TorchBackend(target)
    engine = Engine(
        scorer,
        ModelDrafter(TorchBackend(draft), 64, 1024),
        tokenizer=target.tokenizer,
        eos_token_ids=target.eos_token_ids,
        config=EngineConfig(max_batch=64, max_len=1024, num_draft_tokens=3),
    )
    prompts = [engine.encode(text, chat=True) for text in build_workload(16)]
    for width in widths:
        for name, method, policy in [
            ("beam", "beam", None),
            ("dsbd, γ = 3", "dsbd", None),
            ("dsbd, adaptive γ <= 3", "dsbd", DraftLength()),
        ]:
            engine.reconfigure(draft_length=policy)
            per_token = []
            for seed in (0, 100):
                requests = [
                    engine.request(p, max_tokens=32, temperature=1.0, seed=seed + i, beam=BeamParams(width=width))
                    for i, p in enumerate(prompts)
                ]
                for p, out in zip(prompts, engine.generate(requests, method).outputs):
                    per_token.append(continuation_logprob(scorer, p, out.token_ids) / max(1, len(out.token_ids)))
            mean, se = statistics.fmean(per_token), statistics.stdev(per_token) / len(per_token) ** 0.5
            print(
                f"W = {width}, {name}: log-likelihood / token {mean:.3f} ± {se:.3f} (n = {len(per_token)})", flush=True
            )


if __name__ == "__main__":
    main([int(w) for w in sys.argv[1:]] or [2, 3])
