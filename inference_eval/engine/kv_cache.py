"""Paged key/value storage for one model.

Layout per layer: [num_pages, page_size, kv_heads, head_dim] (FlashInfer's NHD layout), so
the same tensors serve the torch backend (as flat slots) and FlashInfer's paged kernels.

A latent cache (`values=False`, multi-head latent attention) stores one row per token and
layer, [c_kv ; k_pe] of kv_lora_rank + qk_rope_head_dim, which serves as key and value at
once: `v` is the same tensor as `k`, and bytes per token are
num_layers * (kv_lora_rank + qk_rope_head_dim) * dtype size.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", *, values: bool = True) -> None:
        shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device) if values else self.k
        self.page_size, self.num_pages = page_size, num_pages

    @classmethod
    def for_arch(cls, arch, num_pages: int, page_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> "KVCache":
        """The cache a ModelArch needs: K and V, or one latent row per token for MLA."""
        return cls(arch.num_layers, num_pages, page_size, arch.num_kv_heads, arch.head_dim,
                   dtype, device, values=not arch.is_mla)

    @property
    def is_latent(self) -> bool:
        return self.v is self.k

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layer i, each [num_pages, page_size, kv_heads, head_dim] (the
        same tensor twice for a latent cache)."""
        return self.k[i], self.v[i]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from flat slots src [M] to dst [M] (slot = page * page_size
        + offset); used to compact an accepted tree path. The source rows are gathered before
        any write, so overlapping src/dst are safe."""
        if src.numel() == 0:
            return
        for t in (self.k,) if self.is_latent else (self.k, self.v):
            flat = t.view(t.shape[0], -1, *t.shape[3:])
            flat[:, dst] = flat[:, src]

    def nbytes(self) -> int:
        """Bytes this cache holds (a latent cache counts its one tensor once)."""
        k = self.k.numel() * self.k.element_size()
        return k if self.is_latent else 2 * k

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def bytes_per_token_for_arch(arch, dtype: torch.dtype) -> int:
        """K + V bytes per token over all layers; the latent row alone for MLA."""
        full = KVCache.bytes_per_token(arch.num_layers, arch.num_kv_heads, arch.head_dim, dtype)
        return full // 2 if arch.is_mla else full
