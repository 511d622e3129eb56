"""``specdec distill``: make a cheap draft model that agrees with a target, on a CPU, resumably.

Why: speculation with a draft model pays only when the draft is cheap and agrees with the
target, and a small model sharing the target's tokenizer rarely exists (none does on PyPI for
SmolLM2). The recipe, one module per step (each module's docstring tells the step in full):

1. **Prompts** (:mod:`specdec.distill.prompts`) — 2,000 built-in chat prompts, ``--prompts FILE``,
   and with ``--self-prompts N`` requests that a chat target writes itself.
2. **Data** (:mod:`specdec.distill.records`, :mod:`specdec.distill.data`) — target continuations
   of the prompts, sampled at temperature 1 by our own runtime, with the target's top-``k``
   log-probabilities from the same forward pass, in resumable shards under ``OUT/.work``; split
   by prompt into held-out, validation and training sets, plus greedy continuations.
3. **Draft** (:mod:`specdec.distill.net`) — ``--layers`` LLaMA layers of the target's width
   initialised from target layers, the target's embeddings reused, an LM head restricted to
   the ``--head-size`` most frequent tokens (or grown from a finished draft with ``--init-from``).
4. **Training** (:mod:`specdec.distill.objective`, :mod:`specdec.distill.train`) —
   cross-entropy to the teacher restricted to the head, AdamW, bounded by ``--minutes`` or
   ``--steps``, checkpointed so an interrupted run resumes where it stopped.
5. **Evaluation** (:func:`specdec.distill.objective.evaluate`) on held-out continuations with
   the full target distribution.
6. **Output** (:func:`specdec.distill.train.distill`, written by :mod:`specdec.models.drafts`) —
   ``OUT/model.safetensors`` (the draft's own weights, fp16), ``config.json``,
   ``head_token_ids.json`` and ``specdec_draft.json`` (command, data size, seed, metrics and
   the target's checksum: loading the draft for another target fails clearly).

:mod:`specdec.distill.settings` holds the recipe's settings and :mod:`specdec.distill.cli` the
``specdec distill`` command line. The modules build on each other in that order (settings,
records, prompts, data, net, objective, train, cli); nothing is re-exported here, so every name
has one import path.
"""
