#!/usr/bin/env bash
# One prepared device check: every CUDA path, each part in its own process under its own time
# limit (a failure or a hang does not hide the rest), then one table (and each part's own). Under 9 minutes on one H200.
#
#   bash benchmarks/gpu_check.sh                       # on the GPU machine (carry .whl: make gpu-bundle)
#   GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh  # the same parts on CPU at tiny sizes (dry run)
#
# GPU_CHECK_OUT (default .gpu-check) receives each part's JSON, the table (table.md) and logs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-.gpu-check}
TOTAL_S=${GPU_CHECK_TOTAL_S:-530}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
START=$(date +%s)

# The GPU machine has no network and no zarr: install the carried wheels, never from an index.
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    # by name: pip keeps what the machine already has and takes only the missing ones from .whl
    names=$(for w in .whl/*.whl; do basename "$w" | cut -d- -f1; done)
    $PY -m pip install --quiet --no-index --find-links .whl $names >"$OUT/pip.log" 2>&1 \
        || echo "pip install of .whl failed (see $OUT/pip.log); the env part names what is missing"
fi

# part:seconds; the benchmark takes what is left of TOTAL_S
# re-cut for the first 10 minutes on one H200 (issue 34): (1) drafter, (3) loader_width, (4) the smoke parts, then
# ddp in a real process group and eval on the device (issue 42),
# teacher_layers (issue 33: a few full-width qwen3_5 layers, which Gated DeltaNet implementation runs),
# DFlash2 (issue 35) and LiLiCorr + conv (issue 56) with what is left;
# the other parts of gpu_check.py run one by one (python benchmarks/gpu_check.py PART --out DIR)
PARTS="env:40 drafter:180 loader_width:60 build:120 loader:40 ddp:120 eval:60 teacher_layers:60 dflash2:120 lilicorr:90"
for entry in $PARTS; do
    part=${entry%%:*}; limit=${entry##*:}
    left=$(( TOTAL_S - ($(date +%s) - START) ))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -le 5 ]; then echo "no time left" >"$OUT/$part.status"; continue; fi
    rm -f "$OUT/$part.json"
    timeout --kill-after=10 "$limit" $PY benchmarks/gpu_check.py "$part" --out "$OUT" >"$OUT/$part.log" 2>&1
    rc=$?
    if [ ! -f "$OUT/$part.json" ]; then
        if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "TIMEOUT ${limit}s" >"$OUT/$part.status"; else echo "CRASH rc=$rc" >"$OUT/$part.status"; fi
    fi
    echo "$part: $(head -c 300 "$OUT/$part.json" 2>/dev/null | grep -o '"status": "[A-Z a-z]*"' || cat "$OUT/$part.status")"
done
$PY benchmarks/gpu_check.py table --out "$OUT" | tee "$OUT/table.md"
for part in drafter loader_width; do [ -f "$OUT/$part.log" ] && { echo; echo "## $part"; grep '^|\|^cache' "$OUT/$part.log"; }; done
! grep -q -E '\| (FAIL|TIMEOUT|CRASH|not run)' "$OUT/table.md"
