#!/usr/bin/env bash
# The one prepared device check: the carried wheels installed, then benchmarks/gpu_check.py's parts,
# each in its own process under its own budget (about 6 minutes in all on one GPU; the parts and
# their budgets are declared in gpu_check.py's CHECK), a line per part, then one table.
#
#   bash benchmarks/gpu_check.sh                                  # on the GPU machine (carry .whl: make gpu-bundle)
#   GPU_CHECK_PARTS="capture eval" bash benchmarks/gpu_check.sh   # a rerun of some parts
#   GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh             # the same parts on CPU at tiny sizes (dry run)
#
# GPU_CHECK_OUT (default .gpu-check) receives each part's JSON and log and the table (table.md);
# GPU_CHECK_TOTAL_S caps the whole check (the driver stops before a part that would not fit).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-.gpu-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"

# The GPU machine has no network and no zarr: install the carried wheels, never from an index.
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    # by name: pip keeps what the machine already has and takes only the missing ones from .whl
    names=$(for w in .whl/*.whl; do basename "$w" | cut -d- -f1; done)
    $PY -m pip install --quiet --no-index --find-links .whl $names >"$OUT/pip.log" 2>&1 \
        || echo "pip install of .whl failed (see $OUT/pip.log); the env part names what is missing"
fi

exec $PY benchmarks/gpu_check.py check --out "$OUT"
