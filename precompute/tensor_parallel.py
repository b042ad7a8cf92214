"""Precompute and distill under `engine.tensor_parallel=T`: world/T data-parallel replicas.

    torchrun --nproc_per_node 8 -m precompute ... engine.tensor_parallel=4   # 2 replicas of 4

Who does what (the engine's own split, inference_eval/engine/parallel/):
- a replica's leader (its rank 0) is data-parallel rank `replica` of `replicas`: it plans,
  runs and writes exactly what that rank writes at T=1 (shard names, progress files,
  checksums, resume, global rank 0's merge), with its model calls broadcast to the replica
  (TPLeader). The final all-reduce leaves the states replicated, so it writes its own output.
- the followers load their shard, then run `runner.follow`: the leader's model calls, until it
  stops them. They hold no data and write nothing.

Process groups, all from the default group init_tensor_parallel opens (its timeout,
engine.tp_timeout_s, bounds every wait on a dead or stuck rank):
- the replica's TP group (step broadcasts, the model's collectives): engine.tp_timeout_s;
- `leaders`, gloo over the replicas' leaders: the ledgers' barriers. A leader done with its
  shards waits there for the slowest replica, so it has precompute's barrier timeout (12 h);
  its followers are no longer in it (stopped first), so none waits on a 300 s collective;
- `gate`, gloo per replica, the same 12 h: the followers wait there while their leader reads,
  tokenizes and plans (longer than tp_timeout_s on a large dataset), then learn whether to
  serve (1) or to stop (0: the leader has nothing to run, or failed before serving).
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager, suppress
from typing import Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from inference_eval.engine.config import EngineConfig
from inference_eval.engine.parallel.group import (TPGroup, check_world, close_tensor_parallel,
                                                  init_tensor_parallel)
from inference_eval.engine.parallel.runner import (TPLeader, follow, load_tp_target,
                                                   tp_engine_config)
from inference_eval.engine.parallel.shard import ShardPlan
from inference_eval.engine.parallel.step_sync import StepChannel
from inference_eval.engine.target import LoadedTarget, TargetConfig
from precompute.distributed import BARRIER_TIMEOUT

R = TypeVar("R")


class LeaderModel(TPLeader):
    """TPLeader as precompute's dump reads a TransformerLM (its `cpu_blas` switch and
    `lm_head_weight`, whose dtype picks the kernels)."""

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.inner.lm_head_weight

    @property
    def cpu_blas(self) -> bool:
        return self.inner.cpu_blas

    @cpu_blas.setter
    def cpu_blas(self, on: bool) -> None:
        self.inner.cpu_blas = on


def dump_engine(engine: EngineConfig) -> EngineConfig:
    """The followers' settings for precompute's dump, matching what precompute/run.py does on
    the leader: cacheless calls (one page of cache), no weight block codes, the BLAS path
    the leader's rule picks (CPU fp32, unless cpu_blas=torch)."""
    blas = "torch" if engine.cpu_blas == "torch" else "auto"
    return dataclasses.replace(engine, num_pages=1, weight_codes=False, cpu_blas=blas)


@dataclasses.dataclass
class Replica:
    """A replica's leader as the precompute stages see it: data-parallel `rank` of `world`,
    barriers over `group` (the leaders), and the target: load() then serve()."""

    tp: TPGroup
    group: dist.ProcessGroup
    gate: dist.ProcessGroup
    target: TargetConfig
    engine: EngineConfig  # the followers' (and the leader's engine's) settings
    plan: ShardPlan | None = None
    released: bool = False

    @property
    def rank(self) -> int:
        return self.tp.replica

    @property
    def world(self) -> int:
        return self.tp.replicas

    def load(self) -> LoadedTarget:
        """The leader's shard of the target (the followers load theirs meanwhile)."""
        loaded, self.plan = load_tp_target(self.target, self.tp, with_tokenizer=True,
                                           expert_parallel=self.engine.expert_parallel)
        return loaded

    @contextmanager
    def serve(self, loaded: LoadedTarget) -> Iterator[LoadedTarget]:
        """`loaded` with its model broadcasting every call to the followers, which wait at
        the gate until here; leaving the block stops them (also when the body raised)."""
        _open_gate(self.gate, self.tp, go=True)
        self.released = True
        channel = StepChannel(self.tp)
        model = LeaderModel(loaded.model, self.plan.local_arch(), channel)
        try:
            yield dataclasses.replace(loaded, model=model)
        except BaseException:
            with suppress(Exception):  # followers still up stop too
                channel.send(None)
            raise
        channel.send(None)

    def release(self) -> None:
        """Followers still at the gate (the leader ends without serving) stop."""
        if not self.released:
            self.released = True
            _open_gate(self.gate, self.tp, go=False)


def run_replicated(target: TargetConfig, engine: EngineConfig, follow_cfg: EngineConfig,
                   lead: Callable[[Replica], R]) -> R | None:
    """Under torchrun: open the groups; the leaders run lead(replica) (its result), the
    followers serve their leader's model calls (None). follow_cfg: what the leader's model
    calls need of the followers (the engine's cache geometry and kernels)."""
    t = engine.tensor_parallel
    tp = init_tensor_parallel(t, engine.device, engine.tp_timeout_s)
    try:
        world = dist.get_world_size()
        # Every rank creates every group, in the same order (torch.distributed's rule).
        leaders = dist.new_group(list(range(0, world, t)), backend="gloo",
                                 timeout=BARRIER_TIMEOUT)
        gates = [dist.new_group(list(range(r, r + t)), backend="gloo", timeout=BARRIER_TIMEOUT)
                 for r in range(0, world, t)]
        replica = Replica(tp, leaders, gates[tp.replica], target, tp_engine_config(follow_cfg))
        if not tp.is_leader:
            _follow(replica)
            return None
        try:
            return lead(replica)
        finally:
            with suppress(Exception):  # after a failure the followers may be gone already
                replica.release()
    finally:
        close_tensor_parallel()


def check_launch(tensor_parallel: int) -> None:
    """One clear line, before any data or group, for a launch that cannot split:
    T > 1 without torchrun, or a world size that T does not divide (group.check_world)."""
    if tensor_parallel > 1:
        check_world(tensor_parallel)


def _follow(replica: Replica) -> int:
    loaded, plan = load_tp_target(replica.target, replica.tp, with_tokenizer=False,
                                  expert_parallel=replica.engine.expert_parallel)
    if not _open_gate(replica.gate, replica.tp, go=False):
        return 0
    return follow(loaded.model, plan.local_arch(), replica.engine, StepChannel(replica.tp))


def _open_gate(gate: dist.ProcessGroup, tp: TPGroup, go: bool) -> bool:
    """The leader's go (True) or stop to its followers, over the long-timeout gloo group;
    returns the leader's word on every rank."""
    flag = torch.tensor([int(go)], dtype=torch.long)
    dist.broadcast(flag, src=tp.leader, group=gate)
    return bool(flag.item())
