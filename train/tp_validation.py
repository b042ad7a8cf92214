"""Validation under tensor parallelism: `engine.tensor_parallel=T` in a torchrun training run.

    torchrun --nproc_per_node 8 -m train ... validation.enabled=true engine.tensor_parallel=8

The trainer's W ranks also form the engine's W/T replicas of T consecutive ranks, with groups
made from the default group accelerate opened (parallel/group.py joins it). Every rank loads
its shard of the target once, at start (runner.load_tp_target: split tensors are read slice by
slice, the whole target is never on one rank). At each eval step:

- rank 0, replica 0's leader: writes the loop's full head (gathered under FSDP) as a head
  checkpoint and sends its files to its followers, then runs the Validator's measurements
  over a TPLeader: every target forward of the teacher-forced part and every call of the
  real-τ engine is broadcast to the replica;
- ranks 1..T-1, its followers: write the received checkpoint, split that head with their
  target shard (parallel/spec.ShardedHead, as the eval CLI does) and serve the leader's calls
  (runner.follow) until it is done;
- ranks T..W-1, the other replicas: wait at the loop's barrier.

The real τ is the eval CLI's at T (evaluation.engines.build_tp_spec_engine under
runner.serve), equal to T=1's up to floating-point summation order; the teacher-forced part
reads the leader's hidden states, complete after each layer's all-reduce, with the loop's
full head. One replica validates; the others also load a shard (load_tp_target's GGUF
barrier is the default group's), which they do not use yet.
"""
from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import torch

from heads.base import DraftHead
from heads.checkpoint import save_head
from inference_eval.engine.parallel.group import TPGroup, init_tensor_parallel
from inference_eval.engine.parallel.runner import load_tp_target, serve
from inference_eval.engine.parallel.shard import ShardPlan
from inference_eval.engine.target import LoadedTarget
from inference_eval.evaluation.engines import build_tp_spec_engine
from train.config import TrainConfig
from train.distributed import broadcast_dir
from train.validate import Validator, head_draft


class TPValidator:
    """The loop's validator on every rank when engine.tensor_parallel=T > 1 (who does what:
    the module's docstring). device: the trainer's (acc.device), on which the shards live."""

    def __init__(self, cfg: TrainConfig, head: DraftHead, device: torch.device,
                 shared: tuple[TPGroup, LoadedTarget, ShardPlan] | None = None) -> None:
        """shared: the groups and this rank's shard already loaded (online training's
        target, train/online_tp.py), so a rank holds one copy of its shard, not two."""
        self.engine_cfg, self.tau_k = cfg.engine, cfg.validation.tau_num_draft
        self.real_tau = cfg.validation.tau_prompts > 0
        if shared is not None:
            self.tp, self.loaded, self.plan = shared
        else:
            self.tp = init_tensor_parallel(cfg.engine.tensor_parallel, str(device),
                                           cfg.engine.tp_timeout_s)
        lead = self.tp.is_leader and self.tp.replica == 0  # global rank 0
        if shared is None:
            self.loaded, self.plan = load_tp_target(cfg.target, self.tp, with_tokenizer=lead,
                                                    expert_parallel=cfg.engine.expert_parallel)
        self.validator = Validator(cfg, self.loaded) if lead else None

    def __call__(self, head: DraftHead, autocast=contextlib.nullcontext) -> dict | None:
        """Every rank: a collective of replica 0. head: on rank 0 the full head to validate;
        elsewhere the rank's own (only its config is read). Metrics on rank 0, else None."""
        if self.tp.replica != 0:
            return None
        with tempfile.TemporaryDirectory(prefix="specheads_val_head_") as tmp:
            build = make_drafter = None
            if self.real_tau:
                if self.validator is not None:
                    save_head(head, tmp)
                broadcast_dir(Path(tmp), self.tp.leader, self.tp.group, self.tp.device)
                draft = head_draft(tmp, self.tau_k or head.cfg.num_steps)
                build, make_drafter = build_tp_spec_engine(self.loaded, self.plan, self.tp, draft)
            with serve(self.loaded, self.plan, self.engine_cfg, self.tp, build,
                       make_drafter) as engine:
                if engine is None:  # a follower: it served the leader's calls
                    return None
                # The served engine (built from the checkpoint of this very head) is the
                # real-τ run's, and its TPLeader the teacher-forced forwards'.
                return self.validator.measure(head, autocast, engine.model,
                                              lambda _head, _k: engine)
