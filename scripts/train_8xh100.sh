#!/usr/bin/env bash
# Train the MTP draft head of Llama-3.1-70B-Instruct on one 8x H100 80 GB node.
#
#   SHARDS=runs/shards_70b OUT=runs/head_70b bash scripts/train_8xh100.sh [extra overrides...]
#   TARGET=deepseek_v2_lite TARGET_PATH=deepseek-ai/DeepSeek-V2-Lite SHARDS=... OUT=... \
#       bash scripts/train_8xh100.sh        # the head's layer is MLA + a dense MLP there;
#                                           # its memory is in docs/deepseek.md (~6 GB/GPU)
#
# Memory per GPU (docs/memory_70b.md has the arithmetic): the head is one decoder layer of
# the target plus eh_proj, 0.99 B trainable parameters; fp32 weights + grads + AdamW state are
# 15.8 GB, 19.8 GB with DDP's gradient buckets. The frozen embedding and lm_head (untied,
# 128256 x 8192 each) are 8.4 GB in fp32 (the trainer keeps the head in fp32; bf16 autocast
# does the math). A 16k-token micro-batch adds ~10 GB of saved activations, and the chunked
# soft CE keeps ~2 GB of [1024, 128256] logits at a time (full fp32 logits would be 8.4 GB per
# tensor). That is ~47 GB of 80 GB, so plain DDP fits with room to spare:
#   - DDP is the fastest choice (no parameter all-gather per step).
#   - trainer.strategy=fsdp / deepspeed (ZeRO-2) bring the head's states to ~6 GB per GPU,
#     e.g. for head.num_steps=3 with 32k batches. Their checkpoints are gathered like DDP's
#     (full head + AdamW state by parameter name; DeepSpeed's optimizer partitions go through
#     its own engine checkpoint), see train/full_state.py.
# Global batch: 8 ranks x 16384 tokens x grad_accum 2 = 262,144 tokens per optimizer step.
# Rank r reads global micro-batches r, r+8, ... of one endless order (train/data.py): each
# step sees the 16 micro-batches one process with grad_accum 16 would (tested on CPU with 2
# gloo ranks). A restart resumes from $OUT/checkpoints/latest with the same data position,
# optimizer and schedule; a restart on another node count works when NPROC x GRAD_ACCUM stays
# 16 (e.g. NPROC=4 GRAD_ACCUM=4; not with deepspeed), and anything else stops with an error.
#
# Inputs: shards precomputed from this exact target (the trainer refuses others: arch and
# weights fingerprint in manifest.json). TARGET_PATH may be the hub id: the trainer downloads
# config.json, the safetensors index and only the shards holding embed_tokens, norm and
# lm_head (heads/frozen.py), or a local copy.
# Validation is on, at engine.tensor_parallel=$VAL_TP (8: the 8 trainer ranks are one engine
# replica; train/tp_validation.py, docs/training.md "Validation under tensor parallelism"):
# every rank loads its 1/8 of the target once (17.6 GB in bf16, read slice by slice), beside
# the trainer's ~47 GB, and every VAL_EVERY steps the 8 ranks validate together: teacher-
# forced metrics on held-out conversations through the split target, then real speculative
# decoding with the head split like the target (its real τ and α_k, the eval CLI's at TP=8):
# an estimated 20-40 s per validation (not measured yet). Memory per GPU during validation:
# ~47 + 17.6 GB + the 2 GB KV cache + the head's ~4 GB fp32 copy while it is split, ~71 of
# 80 GB; training's activations are freed by then. DeepSeek-V2-Lite (31 GB) fits one GPU:
# VAL_TP=1 validates on rank 0 with the whole target, VAL_TP=2..8 splits it (and its head).
# validation.enabled=false as an extra override turns it off.
set -euo pipefail
cd "$(dirname "$0")/.."

SHARDS=${SHARDS:?set SHARDS to a precompute output_dir made with target=llama3_70b}
OUT=${OUT:-runs/head_70b}
TARGET=${TARGET:-llama3_70b}
TARGET_PATH=${TARGET_PATH:-meta-llama/Llama-3.1-70B-Instruct}
NPROC=${NPROC:-8}
BATCH_TOKENS=${BATCH_TOKENS:-16384}  # per rank and micro-batch
GRAD_ACCUM=${GRAD_ACCUM:-2}
STEPS=${STEPS:-4000}
VAL_TP=${VAL_TP:-8}  # ranks per validation replica; NPROC must be a multiple
VAL_EVERY=${VAL_EVERY:-250}
PYTHON=${PYTHON:-.venv/bin/python}

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}  # 16 threads x 8 ranks oversubscribe the host
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1      # a dead rank aborts the job instead of hanging it
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}  # V-wide chunks fragment

exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m train \
  target="$TARGET" target.path="$TARGET_PATH" \
  head=mtp head.num_steps=1 \
  data.shards="$SHARDS" data.batch_tokens="$BATCH_TOKENS" \
  optim.grad_accum="$GRAD_ACCUM" optim.lr=1e-4 optim.warmup_steps=100 optim.grad_clip=1.0 \
  trainer.strategy=ddp trainer.mixed_precision=bf16 trainer.device=cuda \
  trainer.max_steps="$STEPS" trainer.loss_chunk=1024 \
  trainer.log_every=10 trainer.save_every=250 trainer.progress=true trainer.wandb=offline \
  trainer.eval_every="$VAL_EVERY" validation.enabled=true validation.num_conversations=16 \
  validation.tau_prompts=12 validation.tau_max_new_tokens=64 \
  engine.tensor_parallel="$VAL_TP" engine.device=cuda engine.kv_cache_gb=2 \
  output_dir="$OUT" "$@"
