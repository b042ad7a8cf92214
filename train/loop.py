"""`python -m train`: the training loop. Reads top to bottom: batch, forward, loss, backward,
clip, step, log; checkpointing and validation are called from the loop, not inlined."""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from heads.frozen import load_frozen
from heads.objective import STATS, summarize
from heads.registry import build_head
from heads.vocab import build_draft_vocab
from inference_eval.engine.target import load_target
from train.config import TrainConfig
from train.data import MicroBatchStream, ShardStore, draw_seed
from train.distributed import make_accelerator
from train.full_state import FullState
from train.logging import MetricLogger
from train.precision import cast_for_training
from train.schedule import make_optimizer, make_scheduler
from train.state import (RunShape, latest_checkpoint, load_training_state, save_final_head,
                         save_training_state)
from train.online import check_warm_start_target, online_progress, online_source
from train.online_tp import check_online_launch
from train.recipe import init_from_target_layer, rollout_depth, steps_from_epochs, warm_start
from train.selection import Selection
from train.tp_validation import TPValidator
from train.validate import Validator


def prepare(cfg: TrainConfig, acc=None):
    """Everything checked before the first step: shards (or the online source), target match,
    head/shard fit. acc: the accelerator (device and ranks of the online target)."""
    if cfg.data.online:
        check_online_launch(cfg)  # engine.tensor_parallel > 1: a launch that can split
        parts = load_frozen(cfg.target)
        if cfg.trainer.init_from is not None:  # before the target runs over the data
            check_warm_start_target(cfg.trainer.init_from, parts)
        store = online_source(cfg, acc)
    else:
        store = ShardStore(cfg.data.shards, verify=cfg.data.verify_checksums)
        parts = load_frozen(cfg.target)
    store.check_target(parts.identity)
    head_cfg = cfg.head
    if head_cfg.reads_aux:
        if not store.aux_layers:
            if cfg.data.online:
                raise ValueError(f"head={head_cfg.type} needs auxiliary layers, but online "
                                 f"training runs with data.aux={cfg.data.aux}: set "
                                 "data.aux=auto or eagle3 (or layer ids)")
            raise ValueError(f"head={head_cfg.type} needs auxiliary layers, but {cfg.data.shards} was "
                             "precomputed with aux=none; precompute again with aux=eagle3")
        head_cfg = replace(head_cfg, aux_layers=store.aux_layers)
    vocab = None
    if head_cfg.draft_vocab_size is not None:
        ids, mask = store.tokens()
        vocab = build_draft_vocab(ids, mask, parts.arch.vocab_size, head_cfg.draft_vocab_size)
    if cfg.trainer.stages:  # saved with the last stage's K; the loop sets K per step
        head_cfg = replace(head_cfg, num_steps=cfg.trainer.stages[-1].num_steps)
    head = build_head(head_cfg, parts, draft_vocab=vocab, seed=cfg.trainer.seed)
    if cfg.trainer.init_from is not None:
        warm_start(head, cfg.trainer.init_from, parts)
    elif cfg.trainer.init_from_target:
        target = load_target(cfg.target, with_tokenizer=False).model
        init_from_target_layer(head, target.layers[-1].state_dict(), target.norm.weight)
        del target
    return store, parts, head


def total_steps(cfg: TrainConfig, store: ShardStore, micro_batches_per_step: int) -> int:
    tc = cfg.trainer
    if tc.epochs is None:
        return tc.max_steps
    batches = len(store.batches(cfg.data.batch_tokens, tc.seed, 0))
    return steps_from_epochs(tc.epochs, batches, micro_batches_per_step)


def train(cfg: TrainConfig) -> dict:
    acc, strategy = make_accelerator(cfg.trainer, cfg.optim)
    store, parts, head = prepare(cfg, acc)
    out = Path(cfg.output_dir)
    ck_root = out / "checkpoints"
    tc, oc = cfg.trainer, cfg.optim
    shape = RunShape(acc.num_processes, oc.grad_accum, cfg.data.batch_tokens, tc.seed, strategy)
    max_steps = total_steps(cfg, store, shape.micro_batches_per_step)
    final_k = head.cfg.num_steps
    head = cast_for_training(head, acc.mixed_precision)
    trainable = list(head.trainable_state())
    opt = make_optimizer([p for p in head.parameters() if p.requires_grad], oc)
    sched = make_scheduler(opt, oc, max_steps)
    start, position, resume = 0, 0, None
    ck = latest_checkpoint(ck_root)
    if ck is not None:
        resume = load_training_state(ck, head, sched, shape)
        start, position = resume.step, resume.position
        acc.print(f"resuming from {ck} at step {start}")
    # The validator (target + held-out data) is built before the first step, so its errors
    # do not wait for the first evaluation. It lives on rank 0 with the whole target, or at
    # engine.tensor_parallel > 1 on every rank, each with its shard (train/tp_validation.py).
    validator = None
    if cfg.validation.enabled and cfg.engine.tensor_parallel > 1:
        validator = TPValidator(cfg, head, acc.device, shared=getattr(store, "tp_shard", None))
    elif cfg.validation.enabled and acc.is_main_process:
        validator = Validator(cfg)
    # The scheduler stays unprepared: accelerate's wrapper steps it num_processes times per
    # optimizer step (it assumes the batch grows with the world), which would make a DDP run's
    # schedule differ from one process's with the same global batch.
    model, opt = acc.prepare(head, opt)
    full = FullState(strategy, model, opt, head, trainable, acc.device, acc.is_main_process,
                     acc.wait_for_everyone)
    if resume is not None:  # optimizer state: after prepare, where FSDP/ZeRO shard it
        if resume.engine_dir is not None:
            full.load_engine(resume.engine_dir)
        else:
            full.load_optimizer_state(resume.optimizer)
    stream = MicroBatchStream(store, cfg.data.batch_tokens, tc.seed, acc.process_index,
                              acc.num_processes, position=position)
    logger = MetricLogger(cfg, out, enabled=acc.is_main_process)
    selection = Selection(out, tc.early_stop_patience) if acc.is_main_process else None
    bar = tqdm(total=max_steps, initial=start, desc="train", disable=not (tc.progress and acc.is_main_process))
    window = None
    t0, tokens, micro = time.perf_counter(), 0, 0
    seen = position * cfg.data.batch_tokens  # token budget passed, for the acceptance curve
    last = {}
    done = start

    def validate(step: int, k: int) -> bool:
        """Validate and select the head as it will be saved (K = final_k); a collective.
        Returns whether to stop early (every rank gets rank 0's decision)."""
        head.cfg.num_steps = final_k
        val, val_head = evaluate(validator, full, parts, acc)
        head.cfg.num_steps = k
        stop = False
        if val is not None:
            logger.log({"step": step, **{f"val/{n}": v for n, v in val.items()}})
            bar.write(validation_line(step, val))
            stop = selection.update(step, seen, val, val_head)
        return bool(acc.reduce(torch.tensor([float(stop)], device=acc.device), "sum").item())

    if cfg.validation.enabled and tc.init_from is not None and start == 0:
        # A warm start is scored before its first step (step 0), so best/ never holds a head
        # worse than the one the run started from (a K=4 fine-tune of a K=1 head can lose).
        validate(0, rollout_depth(tc.stages, 0, max_steps, final_k))
    for step in range(start, max_steps):
        k = rollout_depth(tc.stages, step, max_steps, final_k)
        if window is not None and window.shape[0] != k:  # a stage boundary: log what it did
            if micro:
                last = log_window(acc, logger, bar, window, micro, tokens, t0, sched, step)
            window = None
        if window is None:
            head.cfg.num_steps = k
            window, micro = torch.zeros(k, STATS), 0
        for _ in range(oc.grad_accum):
            batch = store.collate(stream.next())
            batch = replace(batch, draw_seed=draw_seed(tc.seed, stream.last_index)).to(acc.device)
            # accelerate divides the loss by grad_accum (DeepSpeed's engine does it itself) and
            # skips the gradient all-reduce on all but the last micro-batch of the step.
            with acc.accumulate(model), acc.autocast():
                loss, stats = model(batch, chunk=tc.loss_chunk)
                acc.backward(loss)
            window += stats.detach().cpu()
            micro += 1
            tokens += batch.input_ids.numel()
        seen += cfg.data.batch_tokens * shape.micro_batches_per_step
        if oc.grad_clip > 0:
            acc.clip_grad_norm_(model.parameters(), oc.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        bar.update(1)
        done = step + 1
        if done % tc.log_every == 0 or done == max_steps:
            last = log_window(acc, logger, bar, window, micro, tokens, t0, sched, done)
            if cfg.data.online:  # target tokens/s beside the trainer's
                online_progress(store, bar, last, tokens, t0)
            window.zero_()
            micro = 0
        # Saved before validation (a collective: every rank), so a validation that fails (the
        # engine out of memory, a bad prompt file) loses no training; an early stop between
        # saves saves after it.
        due = done % tc.save_every == 0 or done == max_steps
        if due:
            save_training_state(ck_root, done, full, sched, stream.position, shape, last)
        stop = False
        if cfg.validation.enabled and (done % tc.eval_every == 0 or done == max_steps):
            stop = validate(done, k)
        if stop and not due:
            save_training_state(ck_root, done, full, sched, stream.position, shape, last)
        if stop:
            bar.write(f"early stop at step {done}: real τ did not improve for "
                      f"{tc.early_stop_patience} validations (best: {selection.best if selection else '?'})")
            break
    bar.close()
    head.cfg.num_steps = final_k
    acc.wait_for_everyone()
    save_final_head(full, out, extra={"train": {"steps": done, "strategy": strategy,
                                                "shards": str(cfg.data.shards), "metrics": last}})
    if acc.is_main_process:
        (out / "train_metrics.json").write_text(json.dumps(logger.history, indent=1))
        acc.print(f"head checkpoint written to {out}")
    logger.close()
    return last


def log_window(acc, logger, bar, window: torch.Tensor, micro: int, tokens: int, t0: float,
               sched, step: int) -> dict:
    """Log the mean over every micro-batch of every rank since the last log (a collective)."""
    stats_all = acc.reduce(window.to(acc.device), reduction="sum").cpu()
    last = {"step": step, "loss": float(stats_all[:, 0].mean() / (max(micro, 1) * acc.num_processes)),
            "lr": sched.get_last_lr()[0], "rollout_k": window.shape[0],
            "tokens_per_s": tokens * acc.num_processes / (time.perf_counter() - t0),
            **summarize(stats_all)}
    logger.log(last)
    bar.set_postfix(loss=f"{last['loss']:.3f}", top1=f"{last['top1_acc'][0]:.3f}")
    return last


def evaluate(validator: Validator | TPValidator | None, full: FullState, parts, acc):
    """Collective under FSDP (the head is gathered into a full copy on rank 0) and under
    tensor parallelism (every rank holds a TPValidator: replica 0 runs the target's and the
    head's shards). Returns (metrics, the full head they were measured on) on rank 0, (None,
    None) elsewhere."""
    head = full.module
    if full.strategy == "fsdp":
        weights = full.head_weights()
        if acc.is_main_process and validator is not None:
            with torch.random.fork_rng(devices=[]):  # build_head seeds the global generator
                head = build_head(head.cfg, parts, draft_vocab=weights.get("d2t_ids"))
            head = cast_for_training(head, acc.mixed_precision).to(acc.device)
            head.load_state_dict(weights, strict=False)
    metrics = validator(head, autocast=acc.autocast) if validator is not None else None
    acc.wait_for_everyone()
    return (metrics, head) if metrics is not None else (None, None)


def validation_line(step: int, val: dict) -> str:
    """One console line: held-out teacher-forced agreement beside the engine's real τ."""
    fmt = lambda xs: "[" + ", ".join("-" if x is None else f"{x:.3f}" for x in xs) + "]"  # noqa: E731
    line = (f"validation @ step {step}: top-1 {fmt(val.get('top1_acc', []))}, "
            f"E[sum min(p,q)] {fmt(val.get('exp_accept_sampled', []))}, "
            f"expected τ {val.get('exp_tau_greedy', float('nan')):.3f}")
    if "real_tau" in val:
        line += (f"; real τ {val['real_tau']:.3f}, α {fmt(val['real_per_position_accept_rate'])}"
                 f" on {val['real_num_prompts']} prompts")
    return line
