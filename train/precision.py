"""Dtypes of a head in training: fp32 master weights, frozen target tensors left as loaded.

`head.float()` would also upcast the frozen embedding and lm_head buffers: for a bf16 70B
target that is 4.2 GB more per GPU, twice that when the two are tied (a module cast converts
every buffer separately, so one shared tensor becomes two copies), and under bf16 autocast
each matmul casts them back to bf16 anyway. So only the trainable parameters are upcast; the
frozen tensors keep their dtype under mixed precision (autocast computes in bf16/fp16 and the
rows the head gathers are cast on the fly, heads/base.py) and are upcast once, tied ones
together, only when training runs in plain fp32, where a matmul needs one dtype.
"""
from __future__ import annotations

import torch
from torch import nn


def cast_for_training(head: nn.Module, precision: str) -> nn.Module:
    """precision: "no" | "bf16" | "fp16" (resolved, train/distributed.resolve_precision).
    Returns the head, cast in place."""
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
        if precision != "no":
            return head
        upcast: dict[tuple, torch.Tensor] = {}  # one fp32 copy per source tensor (tied share)

        def once(t: torch.Tensor) -> torch.Tensor:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            if key not in upcast:
                upcast[key] = t.float()
            return upcast[key]

        for mod in head.modules():
            for name, buf in list(mod.named_buffers(recurse=False)):
                if buf.is_floating_point() and buf.dtype != torch.float32:
                    setattr(mod, name, once(buf))
            for p in mod.parameters(recurse=False):
                if not p.requires_grad and p.dtype != torch.float32:
                    p.data = once(p.data)
    return head
