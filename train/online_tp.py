"""Online training under `engine.tensor_parallel=T`: T ranks share one target, split.

    torchrun --nproc_per_node 8 -m train target=llama3_70b head=mtp data.online=true \\
        source=sharegpt engine.tensor_parallel=8

The trainer's W ranks form W/T groups of T consecutive ranks (parallel/group.py, over the
default group accelerate opened); each rank loads only its shard of the target
(runner.load_tp_target). The trainer itself stays data parallel over all W ranks: rank r
trains on global micro-batches r, r+W, ... as from shards, so the head is the one trained
from shards precomputed at the same T (`torchrun -m precompute ... engine.tensor_parallel=T`,
whose states differ from T=1's by the row-parallel sums' order only).

Who does what, per group (its leader: the group's rank 0, data-parallel replica `replica`):
- regeneration: the leader answers the prompts of distill rank `replica` of `replicas`
  (precompute/distill/memory.py) over a LeaderModel, every model call broadcast to the
  followers, which serve them (runner.follow) until it sends None; then the records are
  gathered on every rank, as at T=1 (followers bring none);
- without regeneration, every collate() (every rank calls it once per micro-batch, in
  lockstep: train/loop.py's steps x grad_accum): the members' seq_ids go to the leader
  (gather_object on the group), which runs the forwards of precompute's plan that they need
  (OnlineSource's plan and cache; the followers serve them with precompute's dump settings,
  tensor_parallel.dump_engine), stops the followers and sends each member its rows
  (scatter_object_list, CPU tensors). The states travel leader -> member once per
  micro-batch: T-1 micro-batches' hidden (and aux) rows per group.

A rank that fails stops the job: torchrun ends the others (the group's collectives carry
engine.tp_timeout_s in any case).
"""
from __future__ import annotations

import dataclasses
import time
from contextlib import suppress

import torch
import torch.distributed as dist

from inference_eval.engine.model.linear import set_cpu_blas
from inference_eval.engine.parallel.group import check_world, init_tensor_parallel
from inference_eval.engine.parallel.runner import follow, load_tp_target, tp_engine_config
from inference_eval.engine.parallel.step_sync import StepChannel
from precompute.distill import DistillConfig
from precompute.distill.memory import answer_in_memory
from precompute.tensor_parallel import LeaderModel, dump_engine
from train.config import TrainConfig
from train.online import OnlineSource


def check_online_launch(cfg: TrainConfig) -> None:
    """One clear line before any work for a launch that cannot split: engine.tensor_parallel
    > 1 without torchrun, or a world size it does not divide (group.check_world)."""
    if cfg.data.online and cfg.engine.tensor_parallel > 1:
        check_world(cfg.engine.tensor_parallel)


class TPOnlineSource(OnlineSource):
    """OnlineSource whose target is split over this rank's group (the module's docstring)."""

    def __init__(self, cfg: TrainConfig, device: torch.device, rank: int, world: int,
                 gather=None) -> None:
        check_online_launch(cfg)
        self.tp = init_tensor_parallel(cfg.engine.tensor_parallel, str(device),
                                       cfg.engine.tp_timeout_s)
        self.leads = self.tp.is_leader
        self.channel = StepChannel(self.tp)
        # What the followers' shard runs: the engine's calls (regeneration) or precompute's
        # cacheless dump forwards, with the leader's settings.
        engine = cfg.engine if cfg.source.regenerate else dump_engine(cfg.engine)
        self.follow_cfg = tp_engine_config(engine)
        super().__init__(cfg, device, rank, world, gather)
        self.dump_blas = bool(getattr(self.model, "cpu_blas", False))

    def _forward(self, k: int) -> None:
        # A TP validator serves its engine from this same shard and switches the weights'
        # block codes on; the dump's forwards run without them (precompute's bits).
        set_cpu_blas(self.model, self.dump_blas, codes=False)
        super()._forward(k)

    def _load(self, cfg: TrainConfig, device: torch.device):
        """This rank's shard; on the leader its model broadcasts every call to the group."""
        loaded, plan = load_tp_target(
            cfg.target, self.tp, with_tokenizer=self.leads or not cfg.source.regenerate,
            expert_parallel=cfg.engine.expert_parallel)
        self.shard, self.local_arch = loaded.model, plan.local_arch()
        self.tp_shard = (self.tp, loaded, plan)  # the TP validator's too (train/loop.py)
        if not self.leads:
            return loaded
        return dataclasses.replace(
            loaded, model=LeaderModel(loaded.model, self.local_arch, self.channel))

    def _serve(self) -> None:
        """A follower: run the leader's calls on this rank's shard until it sends None."""
        follow(self.shard, self.local_arch, self.follow_cfg, self.channel)

    def _stop_followers(self) -> None:
        self.channel.send(None)

    # ---- regeneration: the leader answers replica `replica`'s share -------------------------
    def _answer_share(self, dcfg: DistillConfig, loaded, rank: int, world: int, count
                      ) -> tuple[dict, list]:
        if not self.leads:
            self._serve()
            return {}, []
        dcfg = dataclasses.replace(dcfg, engine=self.follow_cfg)  # the followers' settings
        try:
            mine, rejects, _ = answer_in_memory(dcfg, loaded, self.tp.replica,
                                                self.tp.replicas, on_batch=count)
        except BaseException:
            with suppress(Exception):  # followers still up stop too
                self._stop_followers()
            raise
        self._stop_followers()
        return mine, rejects

    # ---- without regeneration: the group's micro-batches, forwarded on the leader -----------
    def _rows(self, seq_ids: list[int]) -> list[tuple]:
        """A collective of the group: every member's `seq_ids` go to the leader, which sends
        each its stored rows (hidden [T, H] or fp8 (q, scale), aux [T, A, H] or None)."""
        if self.captured is not None:  # regenerated: every rank holds every record's states
            return super()._rows(seq_ids)
        tp, t0 = self.tp, time.perf_counter()
        wanted = [None] * tp.size if self.leads else None
        dist.gather_object(seq_ids, wanted, dst=tp.leader, group=tp.group)
        if not self.leads:
            self._serve()
            got = [None]
            dist.scatter_object_list(got, None, src=tp.leader, group=tp.group)
            self.target_secs += time.perf_counter() - t0
            return got[0]
        try:
            rows = [super(TPOnlineSource, self)._rows(ids) for ids in wanted]
        except BaseException:
            with suppress(Exception):
                self._stop_followers()
            raise
        self._stop_followers()
        # The leader keeps its own rows (None: not pickled); a member's travel compacted.
        out = [None] + [[(_own(h), _own(a)) for h, a in r] for r in rows[1:]]
        dist.scatter_object_list([None], out, src=tp.leader, group=tp.group)
        return rows[0]


def _own(x):
    """x without the rest of its batch's storage (a row slice of a float32 forward pickles
    its whole storage); fp8 states are (q, scale) pairs."""
    if isinstance(x, tuple):
        return tuple(_own(t) for t in x)
    if x is not None and x.untyped_storage().nbytes() > x.nbytes:
        return x.clone()
    return x
