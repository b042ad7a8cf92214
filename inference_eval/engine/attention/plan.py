"""The backend interface: `plan` once per step, then `attend` once per layer."""
from __future__ import annotations

from typing import Protocol

import torch

from inference_eval.engine.attention.layout import BatchLayout


class AttentionPlan(Protocol):
    positions: torch.Tensor  # [T] int64 rotary positions
    num_tokens: int

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache) -> torch.Tensor:
        """Append k/v [T, kv_heads, d] to `cache` (if any) and attend; q [T, heads, d] ->
        [T, heads, d]. `cache` is a KVCache or None for cacheless layouts."""
        ...

    def attend_latent(self, layer: int, q: torch.Tensor, latent: torch.Tensor, cache,
                      v_dim: int, scale: float) -> torch.Tensor:
        """Multi-head latent attention (DeepSeek, absorbed form): append latent rows
        [T, 1, D] to `cache` and attend; q [T, heads, D] -> [T, heads, v_dim] (mla_torch.py)."""
        ...


class AttentionBackend(Protocol):
    name: str
    graphs: object | None  # model/cuda_graphs.CudaGraphs where steps replay as CUDA graphs

    def plan(self, layout: BatchLayout) -> AttentionPlan: ...


def make_backend(name: str, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None) -> AttentionBackend:
    """`auto` picks FlashInfer on CUDA when it is installed and the cache's `dtype` is one its
    kernels take (float16/bfloat16; None: not known yet), else the torch backend: an fp32
    target on a GPU (the default SmolLM2 dtype) runs rather than being refused."""
    from inference_eval.engine.attention.torch_backend import TorchAttentionBackend

    dev = torch.device(device)
    if name == "torch":
        return TorchAttentionBackend(dev)
    if name in ("flashinfer", "auto"):
        from inference_eval.engine.attention import flashinfer_backend as fib

        half = dtype is None or dtype in (torch.float16, torch.bfloat16)
        if name == "flashinfer" and not half:
            raise ValueError(f"attention backend 'flashinfer' has no {dtype} kernels (float16/"
                             "bfloat16 only): set target.dtype=bfloat16 or use attention=torch")
        if dev.type == "cuda" and fib.available() and half:
            return fib.FlashInferBackend(dev)
        if name == "flashinfer":
            raise ValueError(
                "attention backend 'flashinfer' needs CUDA and the flashinfer-python package "
                f"(device={dev}, installed={fib.available()}); use attention=torch or "
                "pip install -e .[gpu]")
        return TorchAttentionBackend(dev)
    raise ValueError(f"unknown attention backend {name!r}; use auto, torch or flashinfer")
