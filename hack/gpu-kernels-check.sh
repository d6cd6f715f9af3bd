#!/usr/bin/env bash
# The Triton kernels on a CUDA host: the compiled kernels against the PyTorch path (tests marked gpu in
# tests/test_kernels.py), then the A/B micro benchmark of a Qwen3-8B-shaped random model (decode and verify
# 17/33/65 step times per path, and the logit difference between them), then whole `ar` / `ddtree` rounds
# with CUDA graphs for both paths. Results go to $OUT (default results/kernels in the repository).
# Runs from any directory; relative OUT and PYTHON paths are taken from the caller's.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
if [[ "$PY" == */* ]]; then PY=$(realpath -ms "$PY"); fi  # -s: a venv's python is a link to the base one
OUT=$(realpath -m "${OUT:-$REPO/results/kernels}")
cd "$REPO"  # tests/ and the PYTHONPATH below are the repository's
export PYTHONPATH=$REPO/engine:$REPO/operator
$PY -m pytest -q -ra tests/test_kernels.py -m gpu
$PY -m ddtree.cli bench --model random:qwen3-8b --micro --kernels both --methods "" --batch-sizes 1 \
    --graphs on --out "$OUT/micro"
$PY -m ddtree.cli bench --model random:qwen3-8b --drafter random:5 --kernels both --methods ar,ddtree \
    --budgets 32 --batch-sizes 1,16 --graphs on --rounds 8 --out "$OUT/rounds"
