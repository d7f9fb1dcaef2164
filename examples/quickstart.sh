#!/usr/bin/env bash
# The quickstart: build a cache from the shipped tiny teacher and corpus, train a drafter on it,
# and report its held-out acceptance before and after training. Run it with `make demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${DEMO_DIR:-demo}
STEPS=${DEMO_STEPS:-1500}

echo "== 1. dflash-cache build: run the teacher once over the corpus =="
dflash-cache build --teacher examples/teacher --data examples/data/chat.jsonl --out "$OUT/cache" --drafter-layers 3 \
    --top-k 32 --shard-size 32MB --chunk-size 512KiB
dflash-cache info "$OUT/cache"
dflash-cache verify "$OUT/cache" --quiet

echo
echo "== 2. dflash-train run: train a 3-layer drafter (B=8) from the cache =="
rm -rf "$OUT/run"
dflash-train run --cache "$OUT/cache" --out "$OUT/run" --config examples/quickstart.toml --steps "$STEPS"
ls "$OUT/run/drafter"
