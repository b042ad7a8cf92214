"""train/loop.py's step with torch's FSDP1 (use_orig_params, gloo, CPU) in place of
accelerate's, which only shards on CUDA: the checkpoint code under test (train/state.py,
train/full_state.py) is the trainer's own, called the way the loop calls it.

    torchrun --nproc_per_node 2 tests/train/fsdp_worker.py [--stop-at N] OVERRIDES...

--stop-at N: leave after step N without the final head (an interrupted run).
"""
from __future__ import annotations

import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from heads.objective import STATS, summarize
from inference_eval.hydra_app import compose
from train.config import TrainConfig
from train.data import MicroBatchStream
from train.full_state import FullState
from train.logging import MetricLogger
from train.loop import prepare
from train.precision import cast_for_training
from train.schedule import make_optimizer, make_scheduler
from train.state import (RunShape, latest_checkpoint, load_training_state, save_final_head,
                         save_training_state)


def main(argv: list[str]) -> None:
    stop_at = None
    if argv[:1] == ["--stop-at"]:
        stop_at, argv = int(argv[1]), argv[2:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = compose("train", TrainConfig, argv)
    tc, oc, out = cfg.trainer, cfg.optim, Path(cfg.output_dir)
    store, parts, head = prepare(cfg)
    shape = RunShape(world, oc.grad_accum, cfg.data.batch_tokens, tc.seed, "fsdp")
    head = cast_for_training(head, "no")
    trainable = list(head.trainable_state())
    opt = make_optimizer([p for p in head.parameters() if p.requires_grad], oc)
    sched = make_scheduler(opt, oc, tc.max_steps)
    start, position, resume = 0, 0, None
    ck = latest_checkpoint(out / "checkpoints")
    if ck is not None:
        resume = load_training_state(ck, head, sched, shape)
        start, position = resume.step, resume.position
    # The optimizer is built before wrapping, as the loop does before acc.prepare: with
    # use_orig_params FSDP keeps the same Parameter objects (as sharded views).
    model = FSDP(head, use_orig_params=True, device_id=torch.device("cpu"))
    full = FullState("fsdp", model, opt, head, trainable, torch.device("cpu"), rank == 0,
                     dist.barrier)
    if resume is not None:
        full.load_optimizer_state(resume.optimizer)
    stream = MicroBatchStream(store, cfg.data.batch_tokens, tc.seed, rank, world, position)
    logger = MetricLogger(cfg, out, enabled=rank == 0)
    last = {}
    for step in range(start, tc.max_steps):
        window = torch.zeros(head.cfg.num_steps, STATS)
        for m in range(oc.grad_accum):
            batch = store.collate(stream.next())
            with model.no_sync() if m < oc.grad_accum - 1 else nullcontext():
                loss, stats = model(batch, chunk=tc.loss_chunk)
                (loss / oc.grad_accum).backward()
            window += stats.detach()
        model.clip_grad_norm_(oc.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(window)
        done = step + 1
        last = {"step": done, "loss": float(window[:, 0].mean() / (oc.grad_accum * world)),
                "lr": sched.get_last_lr()[0], **summarize(window)}
        logger.log(last)
        if done % tc.save_every == 0 or done == tc.max_steps:
            save_training_state(out / "checkpoints", done, full, sched, stream.position, shape, last)
        if done == stop_at:
            break
    else:
        save_final_head(full, out, extra={"train": {"steps": tc.max_steps, "strategy": "fsdp"}})
    logger.close()
    # Both ranks leave together, and without tearing gloo down: a rank that destroyed its
    # group while the other was still in its last collective ended, rarely, in "terminate
    # called without an active exception" (exit -6), even after a barrier (2026-12-04). All
    # files are written and closed by now, so the process ends without C++ destructors.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
