"""The one place that knows about processes: accelerate setup for none/DDP/FSDP/DeepSpeed.

Model code (heads/) stays single-device; this wraps it from outside, so a head is the same
module in a unit test, in one process and under DDP/FSDP/DeepSpeed. One process works
without torchrun; under torchrun the same command scales.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from train.config import OptimConfig, TrainerConfig


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def resolve_precision(cfg: TrainerConfig, device_type: str) -> str:
    if cfg.mixed_precision != "auto":
        return cfg.mixed_precision
    if device_type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def make_accelerator(cfg: TrainerConfig, optim: OptimConfig | None = None):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    optim = optim or OptimConfig()
    cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    strategy = cfg.strategy
    if strategy == "auto":
        strategy = "ddp" if world_size() > 1 else "none"
    if strategy == "none" and world_size() > 1:
        raise ValueError("trainer.strategy=none under torchrun: use ddp, fsdp or deepspeed")
    if strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise ValueError("trainer.strategy=deepspeed needs the deepspeed package (the `gpu` "
                         "extra: pip install -e '.[gpu]'); or use trainer.strategy=fsdp or ddp")
    kwargs = {}
    if strategy == "fsdp":
        from accelerate.utils import FullyShardedDataParallelPlugin

        # use_orig_params: heads mix trainable weights with frozen norms in one module. FSDP1:
        # train/full_state.py gathers with its FULL_STATE_DICT API.
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=1, use_orig_params=True)
    elif strategy == "deepspeed":
        from accelerate.utils import DeepSpeedPlugin

        # The engine clips and accumulates itself; accelerate's clip_grad_norm_ is a no-op there.
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(
            zero_stage=2, gradient_accumulation_steps=optim.grad_accum,
            gradient_clipping=optim.grad_clip if optim.grad_clip > 0 else None)
    # Frozen lm_head/embedding buffers are identical on every rank: never re-broadcast them.
    ddp = DistributedDataParallelKwargs(broadcast_buffers=False)
    acc = Accelerator(cpu=cpu, mixed_precision=resolve_precision(cfg, "cpu" if cpu else "cuda"),
                      gradient_accumulation_steps=optim.grad_accum, kwargs_handlers=[ddp], **kwargs)
    want = {"fsdp": "FSDP", "deepspeed": "DEEPSPEED"}.get(strategy)
    if want and acc.distributed_type.name != want:  # checkpoints gather by strategy: must agree
        # Asked of accelerate, not assumed: it only shards on accelerators (on the CPU it sets
        # up plain DDP), unless told otherwise (tests/train/fsdp_cpu.py).
        fix = ("use trainer.strategy=ddp on the CPU (accelerate does not shard there)" if cpu
               else "launch with torchrun on CUDA devices")
        raise ValueError(f"trainer.strategy={strategy} but accelerate set up "
                         f"{acc.distributed_type.name}; {fix}")
    return acc, strategy


def gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank (online training's records)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


CHUNK_BYTES = 1 << 28  # 256 MiB per broadcast: a 70B head's 4 GB file never sits whole on a GPU


def broadcast_dir(path: Path, src: int, group, device: torch.device) -> None:
    """Collective over `group`: the files of directory `path` on global rank `src` are written
    byte for byte into `path` on the group's other ranks (each its own directory), in chunks
    through `device` (CUDA under NCCL). A head checkpoint reaches the tensor-parallel
    validator's ranks this way whether or not they share a filesystem."""
    import torch.distributed as dist

    sender = dist.get_rank() == src
    files = [[(p.name, p.stat().st_size) for p in sorted(path.iterdir()) if p.is_file()]
             if sender else None]
    dist.broadcast_object_list(files, src=src, group=group, device=device)
    for name, size in files[0]:
        with open(path / name, "rb" if sender else "wb") as f:
            for start in range(0, size, CHUNK_BYTES):
                n = min(CHUNK_BYTES, size - start)
                buf = (torch.frombuffer(bytearray(f.read(n)), dtype=torch.uint8).to(device)
                       if sender else torch.empty(n, dtype=torch.uint8, device=device))
                dist.broadcast(buf, src=src, group=group)
                if not sender:
                    f.write(buf.cpu().numpy().tobytes())
