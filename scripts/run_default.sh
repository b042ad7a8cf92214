#!/usr/bin/env bash
# The main job on the embedded default (SmolLM2-135M-Instruct + ShareGPT), CPU-sized:
#   1. precompute the target's hidden states for a ShareGPT slice,
#   2. train the default RMSNorm-augmented MTP head on them,
#   3. evaluate it in the engine on held-out prompts against draft=none (autoregressive):
#      τ, per-position acceptance, speedup, lossless check -> runs/default/eval/report.md
# Everything lands in runs/default/. Rerunning resumes/reuses what is already there.
# Override sizes with env vars: LIMIT (conversations), STEPS (optimizer steps).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=.venv/bin/python
OUT=${OUT:-runs/default}
LIMIT=${LIMIT:-80}
STEPS=${STEPS:-40}
PROMPTS=${PROMPTS:-8}
$PY -m precompute target=smollm2 data=sharegpt data.limit="$LIMIT" data.max_length=768 \
    output_dir="$OUT/shards"
$PY -m train target=smollm2 head=mtp data.shards="$OUT/shards" output_dir="$OUT/head" \
    trainer.max_steps="$STEPS" trainer.log_every=10 trainer.save_every=20 \
    trainer.eval_every="$STEPS" optim.warmup_steps=5 optim.lr=1e-3 data.batch_tokens=2048 \
    validation.num_conversations=4 validation.max_length=512 trainer.wandb=offline
$PY -m inference_eval target=smollm2 draft=head draft.checkpoint="$OUT/head" draft.num_draft=2 \
    prompts=humaneval prompts.limit="$PROMPTS" sampling.max_new_tokens=64 eval.batch_size=1 \
    output_dir="$OUT/eval"
echo "done: shards in $OUT/shards, head in $OUT/head, report in $OUT/eval/report.md"
