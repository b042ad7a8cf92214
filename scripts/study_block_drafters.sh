#!/usr/bin/env bash
# Block drafters against the EAGLE-3 chain on the embedded SmolLM2, at equal budget:
#   1. precompute ShareGPT shards with the EAGLE-3 aux layers (all four heads read them),
#   2. train, on those shards for the same steps x batch tokens (the same token passes):
#      eagle3 (chain, K=4 rollout), peagle (K=4, all depths in one pass),
#      dflash B=4 and dflash B=8 (one layer), dflash B=4 with two layers,
#   3. evaluate them in one interleaved run against draft=none on held-out prompts of
#      12 categories, greedy, batch 1: τ, α_k, tokens/s, the time split of a round; with
#      TREES=1 also the chain head, P-EAGLE and DFlash B=4 as trees of 6 nodes (top-2); with
#      MARKOV=1 also P-EAGLE K=4 and DFlash B=4 with the in-block transition bias
#      (head.markov_rank=$RANK), trained the same way; with DSPARK=1 also DSpark: DFlash
#      B=4 with the bias on every draft (head.markov_first=true) and the confidence head,
#      evaluated plain and with the cut reading its head (draft.min_confidence=$CUT)
#      -> $EVAL/report.md and report.json (the chain is listed first, so every other head's
#      row holds its τ less the chain's with the paired 95% interval over the prompts).
# Env: N (conversations, 160), STEPS (150), BATCH (2048), VOCAB (8192), PER_CAT (1), NEW (48),
# REPEATS (3), TREES (0), MARKOV (0), DSPARK (0), RANK (64), CUT (0.2), OUT (runs/block_study),
# EVAL ($OUT/eval).
# Reruns reuse what is there (every stage resumes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
N=${N:-160}; STEPS=${STEPS:-150}; BATCH=${BATCH:-2048}; VOCAB=${VOCAB:-8192}
PER_CAT=${PER_CAT:-1}; NEW=${NEW:-48}; REPEATS=${REPEATS:-3}; OUT=${OUT:-runs/block_study}
TREES=${TREES:-0}; EVAL=${EVAL:-$OUT/eval}; MARKOV=${MARKOV:-0}; RANK=${RANK:-64}
DSPARK=${DSPARK:-0}; CUT=${CUT:-0.2}
export WANDB_MODE=${WANDB_MODE:-disabled}

$PY -m precompute target=smollm2 data=sharegpt data.limit="$N" data.max_length=768 aux=eagle3 \
    output_dir="$OUT/shards"

common=(target=smollm2 data.shards="$OUT/shards" data.batch_tokens="$BATCH"
        head.draft_vocab_size="$VOCAB" trainer.max_steps="$STEPS" trainer.log_every=20
        optim.lr=1e-3 optim.warmup_steps=10 trainer.save_every="$STEPS"
        trainer.eval_every="$STEPS" validation.num_conversations=4 validation.max_length=512
        validation.tau_prompts=4 validation.tau_prompts_path=heldout_mix
        validation.tau_max_new_tokens=32)
train() {  # name, then the head's overrides
  local name=$1; shift
  [ -e "$OUT/$name/checkpoints/best" ] && return 0
  $PY -m train "${common[@]}" output_dir="$OUT/$name" "$@"
}
train eagle3 head=eagle3 head.num_steps=4 validation.tau_num_draft=4
train peagle head=peagle head.num_steps=4 validation.tau_num_draft=4
train dflash4 head=dflash head.num_steps=3 validation.tau_num_draft=3
train dflash8 head=dflash head.num_steps=7 validation.tau_num_draft=7
train dflash4_l2 head=dflash head.num_steps=3 head.num_layers=2 validation.tau_num_draft=3
if [ "$MARKOV" = 1 ]; then
  train peagle_markov head=peagle head.num_steps=4 head.markov_rank="$RANK" validation.tau_num_draft=4
  train dflash4_markov head=dflash head.num_steps=3 head.markov_rank="$RANK" validation.tau_num_draft=3
fi
if [ "$DSPARK" = 1 ]; then
  train dspark4 head=dflash head.num_steps=3 head.markov_rank="$RANK" head.markov_first=true \
      head.confidence_head=true validation.tau_num_draft=3
fi

ck() { echo "$OUT/$1/checkpoints/best"; }
drafts="[{kind:head,checkpoint:$(ck eagle3),name:eagle3_chain4,num_draft:4}"
drafts+=",{kind:head,checkpoint:$(ck peagle),name:peagle4,num_draft:4}"
drafts+=",{kind:head,checkpoint:$(ck dflash4),name:dflash_b4,num_draft:3}"
drafts+=",{kind:head,checkpoint:$(ck dflash8),name:dflash_b8,num_draft:7}"
drafts+=",{kind:head,checkpoint:$(ck dflash4_l2),name:dflash_b4_l2,num_draft:3}"
if [ "$MARKOV" = 1 ]; then
  drafts+=",{kind:head,checkpoint:$(ck peagle_markov),name:peagle4_markov,num_draft:4}"
  drafts+=",{kind:head,checkpoint:$(ck dflash4_markov),name:dflash_b4_markov,num_draft:3}"
fi
if [ "$DSPARK" = 1 ]; then
  drafts+=",{kind:head,checkpoint:$(ck dspark4),name:dspark_b4,num_draft:3}"
  drafts+=",{kind:head,checkpoint:$(ck dspark4),name:dspark_b4_cut,num_draft:3,min_confidence:$CUT}"
fi
if [ "$TREES" = 1 ]; then  # 6 nodes each, top-2 children: the chain's tree against the blocks'
  tree="scheme:tree,topk:2,total_tokens:6"
  drafts+=",{kind:head,checkpoint:$(ck eagle3),name:eagle3_tree,depth:4,$tree}"
  drafts+=",{kind:head,checkpoint:$(ck peagle),name:peagle_tree,depth:4,$tree}"
  drafts+=",{kind:head,checkpoint:$(ck dflash4),name:dflash_b4_tree,depth:3,$tree}"
fi
drafts+="]"
$PY -m inference_eval target=smollm2 "drafts=$drafts" prompts=heldout_mix \
    prompts.per_category="$PER_CAT" sampling.max_new_tokens="$NEW" eval.repeats="$REPEATS" \
    eval.batch_size=1 output_dir="$EVAL"
echo "done: report in $EVAL/report.md"
