"""The distilled draft model vs prompt lookup, each under EMS-SD and the padded baseline, against greedy.

What: SmolLM2-135M as target with the draft that ``specdec distill`` made for it and that ships
as ``smollm2-135m-draft`` (a few target layers, a restricted LM head), and beside it the
prompt-lookup (n-gram) drafter. ``ems`` (EMS-SD), ``vanilla`` (the padded multi-sample
baseline) and ``ar`` (greedy autoregressive decoding) run at batch sizes 1, 4, 8 and 16 for
k = 2, 4 and 6 draft tokens, on two workloads:

* *chat*: 24 general questions and instructions written for this benchmark, none of them a
  prompt the draft was distilled on (``specdec.distill.prompts.builtin_prompts``), chat template
  applied. The answers are new text: what a draft model can predict and prompt lookup rarely can.
* *extractive*: the workload of ``specdec bench`` (summarise or list the points of a
  standard-library docstring, chat template applied): answers copy the prompt, where prompt
  lookup pays.

Why the cost measurement: a speculative step pays when its mean accepted length (tokens per
sequence per step) exceeds its cost in target steps: k draft steps plus one target step that
verifies k + 1 tokens per sequence. So the parts are timed too, at one fixed decode shape
(B sequences, one new token each, ``--context`` cached tokens): ms per ragged step of the
draft and of the target (their ratio is the cost of a draft token relative to a target token)
and of the target verifying k + 1 tokens per sequence. From them the report derives the
break-even mean accepted length of every (B, k) and prints it next to the measured one.

How it is measured, as in ``specdec bench``: one process, one torch thread, greedy decoding;
one engine per batch size over one shared target backend (drafter and k are switched between
runs, the KV cache is sized for the largest k); runs interleaved with their order rotated
between repeats, the median over repeats kept; tokens/s counts prefill. Every output is
compared with ``ar``'s token for token: greedy speculative decoding must reproduce it, and a
difference is reported (in the tables, the JSON and the exit status 1), not raised.

Run::

    python -m benchmarks.draft_pair            # the full grid, about 25 minutes on a 2-core CPU
    python -m benchmarks.draft_pair --quick --out-dir /tmp/draftbench   # smoke run, a few minutes

Writes ``<out-dir>/draft_pair.{json,md,png}`` (default ``benchmarks/results``).
"""

from __future__ import annotations

DEFAULT_DRAFT = "smollm2-135m-draft"
WORKLOADS = ("chat", "extractive")
DRAFTERS = ("draft", "ngram")  # the distilled draft model; prompt lookup
DRAFTER_LABELS = {"draft": "draft model", "ngram": "n-gram"}
SPECULATIVE = ("ems", "vanilla")
COST_TARGET = 0.15  # the bound: a draft token costs at most 15 % of a target token
