"""GPU check of the Triton RaggedTreeAttention kernel: correctness against the torch reference, then timing.

Why one script: GPU time is scarce and lent by chance, so everything that needs the device runs
in one pass that fits the lease (default budget 420 s, hard stop well under 8 minutes):

1. correctness — many random ragged forests (prefill, decode, chains, multi-root forests, idle
   slots, GQA ratios 1/3/4/4, head dims 64/80/128, cache_mask with holes) in fp32, fp16, bf16:
   kernel output vs the reference run in fp32 on the CPU, caches bitwise equal to the expected
   scatter, idle slots bitwise untouched; plus the CUDA dispatch (``torch_cuda_attention``),
   a host-sync-free launch and a CUDA-graph replay (both reported, not fatal);
2. timing — ms per call of the kernel (default tiles, and a small tile sweep whose outputs must
   agree) against the torch reference (per-sequence SDPA loop) at realistic sizes:
   Hq=32, Hkv=8, D=128, cache 4096, B=1..64 sequences, T up to 512.

Writes ``gpu_check.json`` and ``gpu_check.md`` to $OUT (when set) or benchmarks/results/.
Exit status: 0 all good (or "SKIPPED: no CUDA"), 1 a mismatch, 3 triton missing on a CUDA machine.
``--cpu-interpret`` runs tiny cases through Triton's CPU interpreter: it only tests this script.
"""

from __future__ import annotations

ROOT = -1
TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}  # max |Δ| vs the fp32 reference
