#!/usr/bin/env bash
# Stops `make setup` early, with the numbers, when a first install of the engine's dependencies
# cannot fit: PyPI's torch for Linux brings CUDA libraries, about 5 GiB in the virtualenv, and pip
# fails half-way with "[Errno 28] No space left on device" otherwise.
# Usage: check-disk.sh VENV_PYTHON EXTRAS
set -euo pipefail
python=$1 extras=$2
need_gib=${DDTREE_SETUP_MIN_FREE_GIB:-6}
case ",$extras," in *,engine,*) ;; *) exit 0 ;; esac
if [ -x "$python" ] && "$python" -c 'import torch' 2>/dev/null; then exit 0; fi
# Measure the disk the virtualenv goes to, not the caller's: the python's folder (relative paths are
# the caller's), or its nearest existing parent. -s: a venv's bin/python is a link to the base python.
dir=$(dirname -- "$(realpath -ms -- "$python")")
while [ ! -d "$dir" ]; do dir=$(dirname -- "$dir"); done
free_gib=$(df -Pk -- "$dir" | awk 'NR == 2 { print int($4 / 1048576) }')
if [ "$free_gib" -lt "$need_gib" ]; then
    echo "make setup: $free_gib GiB free on $(df -P -- "$dir" | awk 'NR == 2 { print $6 }'), but installing" \
        "the engine's dependencies (torch with its CUDA libraries) needs about $need_gib GiB." >&2
    echo "Free some space, or install the operator alone with: make setup EXTRAS=operator,dev" \
        "(set DDTREE_SETUP_MIN_FREE_GIB to change the threshold)." >&2
    exit 1
fi
