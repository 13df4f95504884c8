"""Everything a lent GPU should run, in one command: ``scripts/gpu_check.py``.

    python -m minipaged.bench.gpu_check --out DIR             # on a CUDA machine
    python -m minipaged.bench.gpu_check --rehearse --out DIR  # the same flow on a CPU

The check runs ``tests/`` and ``scripts/``, so it lives in the repository's
``scripts/`` (with ``gpu_steps.py``, what each step runs) and works from a
checkout only; this module keeps the command the README and the GPU sessions
name. ``--help`` lists its options.
"""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def main(argv=None) -> int:
    if not (SCRIPTS / "gpu_check.py").is_file():
        raise SystemExit(f"gpu_check runs from a checkout of the repository: "
                         f"{SCRIPTS / 'gpu_check.py'} is not there")
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    import gpu_check  # scripts/gpu_check.py

    return gpu_check.main(argv)


if __name__ == "__main__":
    sys.exit(main())
