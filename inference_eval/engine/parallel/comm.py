"""The collectives tensor parallelism issues, each counted (COUNTS), so tests and
scripts/bench_tp.py can hold a step to one broadcast plus the model's reductions, and time
them (SECONDS, with `timed` on)."""
from __future__ import annotations

import time
from collections import Counter

import torch
import torch.distributed as dist

from inference_eval.engine.parallel.group import TPGroup

COUNTS: Counter = Counter()
SECONDS: Counter = Counter()
timed = False  # time each collective (a CPU sync on CUDA); off on the hot path


def reset() -> None:
    COUNTS.clear()
    SECONDS.clear()


def _run(kind: str, fn, *args, **kwargs):
    COUNTS[kind] += 1
    if not timed:
        return fn(*args, **kwargs)
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if args and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
        torch.cuda.synchronize()
    SECONDS[kind] += time.perf_counter() - t0
    return out


def all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum x over the replica, in place; returns x."""
    _run("all_reduce", dist.all_reduce, x, group=tp.group)
    return x


def broadcast(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The leader's x to every rank of the replica, in place; returns x."""
    _run("broadcast", dist.broadcast, x, src=tp.leader, group=tp.group)
    return x


def gather_to_leader(x: torch.Tensor, tp: TPGroup) -> torch.Tensor | None:
    """Every rank's x [N, C] -> the leader gets [N, size * C] (rank order along columns);
    the other ranks get None."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)] if tp.is_leader else None
    _run("gather", dist.gather, x, parts, dst=tp.leader, group=tp.group)
    return torch.cat(parts, dim=-1) if parts is not None else None
