"""Quantized exports: schemes as strategies (``strategies``) over one graph rewrite (``rewrite``).

``blocks`` (the block format, from GGUF or round to nearest), ``sources`` (the model's tensors),
``nbits`` (MatMulNBits / GatherBlockQuantized), ``w8a8`` and ``calibration`` (integer-GEMM chains);
the export step that runs them is ``specdec.export.quantize``.
"""
