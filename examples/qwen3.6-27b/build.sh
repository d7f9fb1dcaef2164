#!/usr/bin/env bash
# Stage 1 of the Qwen3.6-27B recipe: one 8-GPU node builds the cache through vLLM, one build
# process and one vLLM engine per GPU (dflash-cache build takes no config file: its settings are
# these options; docs/options.md lists them all). Projections (GPU memory, tokens/s, disk, wall
# time) with their arithmetic: docs/production.md. tests/test_production_recipe.py reads the
# args=( ... ) block below and runs it through the real build command.
#
#   DATA=regenerated.jsonl OUT=s3://bucket/qwen3.6-27b bash examples/qwen3.6-27b/build.sh [more options]
#
# More nodes: NNODES=4 RDZV=$HEAD:29500 on every node (each rank takes every 32nd row).
# Rerunning the same command after any interruption resumes; options after the script's name
# are appended (the last one given wins).
set -euo pipefail
DATA=${DATA:?set DATA to the corpus, e.g. dflash-cache regenerate output (regenerated.jsonl)}
OUT=${OUT:?set OUT to the cache URL, e.g. s3://bucket/qwen3.6-27b-cache}

args=(
  --teacher Qwen/Qwen3.6-27B           # the production teacher (Qwen3_5ForConditionalGeneration; its text settings under text_config)
  --engine vllm                        # vLLM's unpadded prefill and Gated-DeltaNet kernels; the same cache bytes as transformers
  --vllm-args '{"gpu_memory_utilization": 0.85}'  # 68 of 80 GB to vLLM (54 GB weights + KV); 12 GB left for our bf16 head and one fp32 logits chunk
  --layers 1,16,31,46,61               # 0-based decoder layers (tapped_layers' rule and default for 64 layers); 63, the last, cannot be served
  --top-k 64                           # the teacher's 64 likeliest next tokens (ids + fp32 log-probs): 517 B/token with the ids and mask, 1% of the hidden bytes
  --dtype bfloat16                     # the teacher's own dtype; stored losslessly as bf16 bits
  --hidden-format lossless             # bf16: 51,717 B/token; fp8_e4m3 halves it (26,122) but the 27B's massive activations are unmeasured
  --max-length 8192                    # production answers are 2-8k tokens; longer rows are cut at 8,192 (vLLM's max_model_len 8,193)
  --overlong truncate                  # keep the first 8,192 tokens of a longer row rather than lose the row
  --logits-chunk 2048                  # positions per fp32 LM-head chunk: 2,048 x 248,320 x 4 B = 2.0 GB of logits at once
  --chat-template-kwargs '{"enable_thinking": false}'  # must equal regenerate's and serving's setting; recorded, a rebuild with another is refused
  --on-bad-row skip                    # a large scraped corpus has some broken rows: count them in the manifest, do not stop 8 GPUs
  --shard-size 512MB                   # 10,000 tokens of hidden states a shard: the unit of commit, resume and parallel reads
)

exec torchrun --nnodes "${NNODES:-1}" --nproc-per-node 8 ${RDZV:+--rdzv-backend c10d --rdzv-endpoint "$RDZV"} \
  --no-python dflash-cache build --data "$DATA" --out "$OUT" "${args[@]}" "$@"
