import os
import sys

# Kernel modules read TRITON_INTERPRET when they are imported: set it before
# any test imports one, so CPU-only machines run Triton kernels interpreted.
try:
    import torch
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

sys.path.insert(0, os.path.dirname(__file__))
