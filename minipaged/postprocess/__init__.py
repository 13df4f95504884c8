"""After sampling: token ids -> text, stop rules -> ``RequestOutput``.

Owns: the incremental detokenizer and the output processor (stop strings
and tokens, ``max_tokens``, ``min_tokens``, building each request's output
per its ``output_kind``). Named apart from ``minipaged.outputs``, which holds
the public output types this package fills in.

May import: ``core`` (sequences), ``outputs``, ``sampling_params``.
"""
