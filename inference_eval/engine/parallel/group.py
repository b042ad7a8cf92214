"""Process groups of the engine's tensor parallelism, from torchrun's environment.

The world splits into world / T data-parallel replicas of T consecutive ranks each; rank 0 of
a replica (its leader) schedules and samples, the others follow (runner.py). Every
collective carries a timeout, so a rank that dies stops the others with an error instead of
a hang.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class TPGroup:
    """One tensor-parallel replica as seen from one rank. `group` is None at size 1."""

    rank: int  # rank inside the replica, 0 = leader
    size: int
    group: dist.ProcessGroup | None
    leader: int  # the leader's global rank (collectives name global ranks)
    replica: int  # data-parallel index of this replica
    replicas: int
    device: torch.device

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def single(cls, device: torch.device) -> "TPGroup":
        return cls(0, 1, None, 0, 0, 1, device)


def check_world(tensor_parallel: int, env: dict[str, str] | None = None) -> tuple[int, int, int]:
    """(global rank, world size, local rank) from torchrun's variables, or one clear error."""
    env = os.environ if env is None else env
    missing = [v for v in TORCHRUN_VARS if v not in env]
    if missing:
        raise ValueError(
            f"engine.tensor_parallel={tensor_parallel} needs one process per rank from torchrun "
            f"(missing {', '.join(missing)}): launch with `torchrun --nproc_per_node "
            f"{tensor_parallel} -m ...`")
    rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    if world % tensor_parallel:
        raise ValueError(f"engine.tensor_parallel={tensor_parallel} does not divide the world "
                         f"size {world}: launch a multiple of {tensor_parallel} processes")
    return rank, world, local


def init_tensor_parallel(tensor_parallel: int, device: str = "auto",
                         timeout_s: float = 300.0) -> TPGroup:
    """Join (or open) the default process group and this rank's replica group.

    device: auto = cuda:LOCAL_RANK when CUDA is available (NCCL), else cpu (gloo)."""
    rank, world, local = check_world(tensor_parallel)
    if device == "auto":
        dev = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
    else:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device(f"cuda:{local}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank,
                                world_size=world, timeout=timeout)
    replicas = world // tensor_parallel
    mine = None
    for r in range(replicas):  # every rank creates every group, in the same order
        ranks = list(range(r * tensor_parallel, (r + 1) * tensor_parallel))
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = g
    replica = rank // tensor_parallel
    return TPGroup(rank % tensor_parallel, tensor_parallel, mine, replica * tensor_parallel,
                   replica, replicas, dev)


def close_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
