"""torch.distributed for the precompute stages: which rank this is, the process group, barriers.

One process works without torchrun; under torchrun each rank takes its share of one global
plan and rank 0 merges. The stages only need barriers, so the group is gloo on every device
(gloo works without GPUs). With engine.tensor_parallel > 1 the ranks are the replicas'
leaders instead, and their barriers run over a group of leaders (precompute/tensor_parallel.py,
the only other module here that touches torch.distributed).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator

import torch

# A barrier waits for the slowest rank to finish its last shard; gloo's default 30 minutes
# is shorter than one large shard of a big target on a slow device.
BARRIER_TIMEOUT = timedelta(hours=12)


def dist_info() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; (0, 1) without it."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


@contextmanager
def process_group(world: int) -> Iterator[None]:
    """A gloo process group for the duration of the block when world > 1."""
    if world > 1:
        init_process_group()
    try:
        yield
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def init_process_group() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=BARRIER_TIMEOUT)


def barrier(group=None) -> None:
    """Every rank of `group` (None: the default group) is here."""
    import torch.distributed as dist

    dist.barrier(group=group)


def rank_device(device: torch.device, world: int) -> torch.device:
    """Under torchrun each rank drives the GPU of its LOCAL_RANK; CPU stays CPU."""
    if device.type == "cuda" and world > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return device
