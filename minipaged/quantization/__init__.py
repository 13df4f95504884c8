"""Weights kept quantized: the layouts (``formats``), GGUF's blocks unpacked
into them (``gguf_blocks``), the GEMMs that read them (``gemm``,
``exact_gemm``) and the layers a model gets (``linear``).

``quantization`` (an engine option) picks a mode (``MODES``):

- ``"none"``: every weight in the activation dtype (a GGUF file dequantized
  at load), as before;
- ``"gguf"``: a GGUF file's linear layers stay in their file's 4- or 8-bit
  form where a GEMM reads it (Q4_0, Q4_1, Q4_K: int4 with groups of 32;
  Q8_0: int8 with groups of 32), other block types are converted at load to
  per-channel int8, and float tensors stay float; the default for a ``.gguf``
  model;
- ``"int8"``: any checkpoint's linear layers quantized at load to int8 with
  one scale per output channel (weight-only).

In both quantized modes the token embedding is an int8 table shared with a
tied head: a Q8_0 table as the file has it where the head's GEMM reads
groups (float32 activations on a CPU), else with one scale per row.

On a CPU, float32 activations read every kept weight in float32 arithmetic
(``exact_gemm``), so greedy tokens follow the dequantized model's; bfloat16
activations use torch's faster bf16 ops (``gemm``).
"""

MODES = ("auto", "none", "gguf", "int8")


def resolve_quantization(mode: str, gguf_model: bool) -> str:
    """The mode ``mode`` means for a model that is (``gguf_model``) or is not a
    GGUF file: ``"auto"`` keeps a GGUF file quantized and leaves any other
    checkpoint as it is. A ``ValueError`` names a bad value, or ``"gguf"``
    asked of a checkpoint that is not a GGUF file."""
    if mode not in MODES:
        raise ValueError(f"quantization must be one of {MODES}, got {mode!r}")
    if mode == "auto":
        return "gguf" if gguf_model else "none"
    if mode == "gguf" and not gguf_model:
        raise ValueError("quantization='gguf' keeps a GGUF file's weights quantized, but the "
                         "model is not a .gguf file; use 'int8' to quantize any checkpoint")
    return mode
