#!/usr/bin/env bash
# The main job on the embedded default (SmolLM2-135M-Instruct + ShareGPT), CPU-sized:
#   1. precompute the target's hidden states for a ShareGPT slice,
#   2. train the default RMSNorm-augmented MTP head on them,
#   3. generate with the engine (the speculative evaluation joins here once it lands).
# Everything lands in runs/default/. Rerunning resumes/reuses what is already there.
# Override sizes with env vars: LIMIT (conversations), STEPS (optimizer steps).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=.venv/bin/python
OUT=${OUT:-runs/default}
LIMIT=${LIMIT:-120}
STEPS=${STEPS:-60}
$PY -m precompute target=smollm2 data=sharegpt data.limit="$LIMIT" data.max_length=1024 \
    output_dir="$OUT/shards"
$PY -m train target=smollm2 head=mtp data.shards="$OUT/shards" output_dir="$OUT/head" \
    trainer.max_steps="$STEPS" trainer.log_every=10 trainer.save_every=30 \
    trainer.eval_every="$STEPS" optim.warmup_steps=10 optim.lr=1e-3 data.batch_tokens=4096 \
    validation.num_conversations=8 trainer.wandb=offline
$PY -m inference_eval.generate target=smollm2 sampling.max_new_tokens=48 \
    'prompts=["Write a Python function that returns the n-th Fibonacci number.","Explain what a KV cache is in one paragraph."]' \
    output="$OUT/generations.jsonl"
echo "done: shards in $OUT/shards, head in $OUT/head (metrics: $OUT/head/metrics.jsonl)"
