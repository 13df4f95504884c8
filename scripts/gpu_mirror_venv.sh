#!/usr/bin/env bash
# A virtual environment that mirrors the lent GPU machine's, for
# `python -m minipaged.bench.gpu_check --rehearse` on a CPU:
#
#   bash scripts/gpu_mirror_venv.sh DIR          # about 5 GB, a few minutes
#   cd REPO && DIR/bin/python -m minipaged.bench.gpu_check --rehearse --out OUT
#
# That machine has Python 3.12, torch 2.11 (a CUDA build, which runs on a CPU
# too), triton 3.6 and transformers 5.17, and of the rest only the packages
# below. minipaged itself is not installed there (it runs from the checkout,
# as here), and what it lacks comes from the wheels the repository carries
# (scripts/gpu_wheelhouse.sh), which gpu_check installs offline.
set -euo pipefail
DIR=${1:?usage: bash scripts/gpu_mirror_venv.sh DIR}

find_python312() {
    for candidate in "${PYTHON312:-}" python3.12; do
        if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            command -v "$candidate"; return
        fi
    done
    if command -v pyenv > /dev/null; then
        for version in $(pyenv versions --bare | grep '^3\.12'); do
            echo "$(pyenv root)/versions/$version/bin/python"; return
        done
    fi
    echo "no Python 3.12 found: install one, or name it in PYTHON312" >&2
    return 1
}

PYTHON=$(find_python312)
"$PYTHON" -m venv "$DIR"
# The image's versions; the host's pip constraints (if any) must not cap them.
export PIP_CONSTRAINT=""
"$DIR/bin/pip" install --quiet "torch==2.11.0" "triton==3.6.0" "transformers==5.17.0"
# NumPy below 2.4: Triton 3.6's interpreter converts one-element arrays with
# int(), which NumPy 2.4 refuses, so the rehearsal's interpreted kernel tests
# would fail on NumPy, not on the kernels. (The GPU runs compiled kernels: its
# NumPy does not matter there. Triton 3.9, CI's, works with NumPy 2.4.)
"$DIR/bin/pip" install --quiet pytest pytest-timeout hypothesis httpx matplotlib \
    prometheus-client "numpy<2.4" safetensors tokenizers huggingface-hub
"$DIR/bin/python" -c "import sys, torch, triton, transformers; print('mirror of the GPU machine:', 'python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
