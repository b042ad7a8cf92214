#!/usr/bin/env bash
# The main job on the embedded default (SmolLM2-135M-Instruct + ShareGPT):
#   1. precompute the target's hidden states for a ShareGPT slice,
#   2. train the default RMSNorm-augmented MTP head on them,
#   3. evaluate it in the engine on held-out prompts against draft=none (autoregressive):
#      τ, per-position acceptance, speedup, lossless check -> $OUT/eval/report.md
# Rerunning resumes/reuses what is already there (precompute and training resume).
#
# PRESET picks the sizes (env vars LIMIT, MAXLEN, STEPS, BATCH, PROMPTS, NEW override them):
#   quick (default)  80 conversations, 40 steps, 8 HumanEval prompts, chain K=2:
#                    minutes on a laptop CPU; a smoke test of the whole pipeline.
#   long             500 conversations (~300k tokens), 150 steps x 2048 tokens (one epoch),
#                    16 prompts, chain K=2, K=4 and an EAGLE-2 tree: about 1.5 h on 2 cores.
#   gpu              20k conversations at 2048 tokens, 6000 steps x 16k tokens, bf16, a 3-step
#                    rollout, all 164 HumanEval prompts at batch 8, chain K=4 and the
#                    EAGLE-2 tree: for one GPU (the precompute uses FlashInfer).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=.venv/bin/python
PRESET=${PRESET:-quick}
case "$PRESET" in
  quick) d=(80 768 40 2048 8 64 runs/default) ;;
  long)  d=(500 768 150 2048 16 64 runs/long) ;;
  gpu)   d=(20000 2048 6000 16384 164 128 runs/gpu) ;;
  *) echo "PRESET=$PRESET: use quick, long or gpu" >&2; exit 2 ;;
esac
LIMIT=${LIMIT:-${d[0]}}; MAXLEN=${MAXLEN:-${d[1]}}; STEPS=${STEPS:-${d[2]}}
BATCH=${BATCH:-${d[3]}}; PROMPTS=${PROMPTS:-${d[4]}}; NEW=${NEW:-${d[5]}}; OUT=${OUT:-${d[6]}}
extra_train=(); extra_eval=(); eval_bs=1; save_every=20
H="$OUT/head"
drafts="[{kind:head,checkpoint:$H,name:chain2,num_draft:2}]"
if [ "$PRESET" = long ]; then
  drafts="[{kind:head,checkpoint:$H,name:chain2,num_draft:2},{kind:head,checkpoint:$H,name:chain4,num_draft:4},{kind:head,checkpoint:$H,name:tree,scheme:tree,depth:4,topk:4,total_tokens:12}]"
elif [ "$PRESET" = gpu ]; then
  extra_train=(target.dtype=bfloat16 head.num_steps=3); save_every=500
  extra_eval=(target.dtype=bfloat16)
  eval_bs=8
  drafts="[{kind:head,checkpoint:$H,name:chain4,num_draft:4},{kind:head,checkpoint:$H,name:tree,scheme:tree}]"
fi
$PY -m precompute target=smollm2 data=sharegpt data.limit="$LIMIT" data.max_length="$MAXLEN" \
    output_dir="$OUT/shards" "${extra_eval[@]}"
$PY -m train target=smollm2 head=mtp data.shards="$OUT/shards" output_dir="$H" \
    trainer.max_steps="$STEPS" trainer.log_every=10 trainer.save_every="$save_every" \
    trainer.eval_every="$STEPS" optim.warmup_steps=5 optim.lr=1e-3 data.batch_tokens="$BATCH" \
    validation.num_conversations=4 validation.max_length=512 trainer.wandb=offline \
    "${extra_train[@]}"
$PY -m inference_eval target=smollm2 "drafts=$drafts" prompts=humaneval prompts.limit="$PROMPTS" \
    sampling.max_new_tokens="$NEW" eval.batch_size="$eval_bs" output_dir="$OUT/eval" \
    "${extra_eval[@]}"
echo "done ($PRESET): shards in $OUT/shards, head in $H, report in $OUT/eval/report.md"
