"""Data parallelism over tensor-parallel replicas, for stages that hand one result back.

`torchrun --nproc_per_node N ... engine.tensor_parallel=T` gives N/T replicas of T ranks
(group.py). Each replica takes every (N/T)-th item of the work, its leader runs them, and the
leaders hand their results to global rank 0, which writes them; the followers only serve
their leader's model calls.

    tp = init_tensor_parallel(T, ...)
    leaders = leaders_group(tp)            # every rank, in the same order
    mine = share(items, tp, "prompts")     # items[replica::replicas]
    parts = gather_to_first(result, tp, leaders)   # a leader's call; rank 0 gets one a replica

Precompute writes per replica instead (precompute/tensor_parallel.py).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Sequence, TypeVar

import torch.distributed as dist

from inference_eval.engine.parallel.group import TPGroup

T = TypeVar("T")

# Replicas finish their shares at different times, so the leaders' gather waits on the
# slowest one: hours on a large eval, far beyond a step collective's engine.tp_timeout_s.
REPLICA_WAIT = timedelta(hours=12)


def leaders_group(tp: TPGroup) -> dist.ProcessGroup | None:
    """A gloo group of the replicas' leaders (None with one replica). Every rank must call
    it, in the same order as its other new_group calls (torch.distributed's rule)."""
    if tp.replicas == 1:
        return None
    return dist.new_group(list(range(0, tp.size * tp.replicas, tp.size)), backend="gloo",
                          timeout=REPLICA_WAIT)


def share(items: Sequence[T], tp: TPGroup, what: str) -> list[T]:
    """This replica's items: every replicas-th, from its index (strided, so the categories of
    an ordered prompt set spread over the replicas)."""
    if len(items) < tp.replicas:
        raise ValueError(f"{len(items)} {what} for {tp.replicas} tensor-parallel replicas "
                         f"(world size / engine.tensor_parallel): give at least {tp.replicas} "
                         f"{what} or launch fewer processes")
    return list(items[tp.replica::tp.replicas])


def unshare(parts: Sequence[Sequence[T]]) -> list[T]:
    """The inverse of share(): replica r's j-th item back at position r + j * replicas."""
    out: list[T] = []
    for j in range(max(len(p) for p in parts)):
        out += [p[j] for p in parts if j < len(p)]
    return out


def gather_to_first(obj: Any, tp: TPGroup, group: dist.ProcessGroup | None) -> list | None:
    """Called by every replica's leader: global rank 0 gets [obj of replica 0, 1, ...], the
    other leaders None."""
    if group is None:
        return [obj]
    out = [None] * tp.replicas if tp.replica == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out
