#!/usr/bin/env bash
# The quickstart: the three-step flow on the shipped tiny teacher and corpus.
#   0. the teacher rewrites the corpus answers in its own words (dflash-cache regenerate)
#   1. the teacher runs once over that corpus into a cache      (dflash-cache build)
#   2. a drafter trains from the cache                          (dflash-train run)
#   3. the drafter is measured: offline and in real speculative decoding (dflash-train eval),
#      in vLLM too when `make serving` has made .venv-vllm; then per benchmark category at T=0 and
#      T=1 on two shipped prompt files of different kinds (MT-Bench's format, GSM8K's format)
# Run it with `make demo`; every step resumes if interrupted.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${DEMO_DIR:-demo}
STEPS=${DEMO_STEPS:-1500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

echo "== 0. dflash-cache regenerate: the teacher answers the corpus prompts itself =="
dflash-cache regenerate --teacher examples/teacher --data examples/data/chat.jsonl --out "$OUT/regenerated.jsonl" \
    --max-new-tokens 160 --dtype float32 --batch-size 64

echo
echo "== 1. dflash-cache build: run the teacher once over the corpus =="
dflash-cache build --teacher examples/teacher --data "$OUT/regenerated.jsonl" --out "$OUT/cache" \
    --tapped-layers 3 --top-k 32 --shard-size 32MB --chunk-size 512KiB
dflash-cache info "$OUT/cache"
dflash-cache verify "$OUT/cache" --quiet

echo
echo "== 2. dflash-train run: train a 3-layer drafter (B=8) from the cache =="
rm -rf "$OUT/run"
dflash-train run --cache "$OUT/cache" --out "$OUT/run" --config examples/quickstart.toml --steps "$STEPS"

# With `make serving` done, step 3 also serves the drafter in vLLM and reports vLLM's accepted length.
ENGINE=dflash
if [ -x .venv-vllm/bin/python ] || [ -n "${DFLASH_VLLM_PYTHON:-}" ]; then ENGINE=both; fi

echo
echo "== 3. dflash-train eval: held-out acceptance, offline and with the teacher (engine: $ENGINE) =="
dflash-train eval --checkpoint "$OUT/run/drafter" --cache "$OUT/cache" \
    --teacher examples/teacher --prompts examples/data/heldout_prompts.jsonl --max-prompts 40 \
    --max-new-tokens 128 --out "$OUT/run/eval.json" --engine "$ENGINE" --quiet

echo
echo "== 4. dflash-train eval per category: MT-Bench- and GSM8K-format prompt files, T=0 and T=1 (engine: $ENGINE) =="
dflash-train eval --checkpoint "$OUT/run/drafter" --teacher examples/teacher \
    --prompts examples/prompts/question.jsonl --prompts examples/prompts/gsm8k.jsonl \
    --temperature 0 --temperature 1 --max-new-tokens 128 --out "$OUT/run/eval_categories.json" --engine "$ENGINE" --quiet
