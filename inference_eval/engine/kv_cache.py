"""Paged key/value storage for one model.

Layout per layer: [num_pages, page_size, kv_heads, head_dim] (FlashInfer's NHD layout), so
the same tensors serve the torch backend (as flat slots) and FlashInfer's paged kernels.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size, self.num_pages = page_size, num_pages

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layer i, each [num_pages, page_size, kv_heads, head_dim]."""
        return self.k[i], self.v[i]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from flat slots src [M] to dst [M] (slot = page * page_size
        + offset); used to compact an accepted tree path. The source rows are gathered before
        any write, so overlapping src/dst are safe."""
        if src.numel() == 0:
            return
        for t in (self.k, self.v):
            flat = t.view(t.shape[0], -1, *t.shape[3:])
            flat[:, dst] = flat[:, src]

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
