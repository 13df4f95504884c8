#!/usr/bin/env bash
# The wheels the lent GPU machine lacks, for its Python (3.12, x86-64 Linux),
# with a requirements.txt naming them. gpu_check installs them offline first
# (pip install --no-index --find-links DIR -r DIR/requirements.txt).
#
#   bash scripts/gpu_wheelhouse.sh [DIR]     # default build/gpu-wheels
#
# That machine reaches no package registry, and what travels to it (the
# working tree plus the paths a run carries) is capped at 64 MiB, so this
# holds only what the GPU steps import and its image does not have: the
# server stack and the openai client, which tests/models/test_real_model.py (a test
# marked `cuda`) imports, with their dependencies. requirements.txt names only
# the packages wanted, so pip keeps whatever the image already has that
# satisfies a dependency (httpx, numpy, ...) and takes the rest from here.
# The versions are the ones CI tests with (book/constraints.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-build/gpu-wheels}
WANTED=(fastapi uvicorn pydantic openai)

rm -rf "$DIR" && mkdir -p "$DIR"
python -m pip download --quiet --dest "$DIR" --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
    --constraint book/constraints.txt "${WANTED[@]}"
printf '%s\n' "${WANTED[@]}" > "$DIR/requirements.txt"
echo "$(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1), in $DIR, for: ${WANTED[*]}"
