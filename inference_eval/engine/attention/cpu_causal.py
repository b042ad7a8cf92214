"""A CPU kernel for steps of whole fresh sequences: each attends causally over its own rows.

Precompute's packed batches and prompt prefills ran one SDPA call per sequence (causal mode,
so it skips the blocks above the diagonal). On SmolLM2's shapes (9 query heads over 3 kv
heads, head_dim 64, fp32) SDPA's CPU kernel runs well below the machine's matrix-product
rate at the lengths chats have: measured on the 2-core Xeon, 2 threads, one layer's causal
attention at 256 / 512 / 1024 / 2048 rows 74 / 90 / 142 / 179 GFLOP/s, against ~300 for the
layer's products on the engine's own kernel. bench_precompute's split had attention at 39% of
the dump's time for ~19% of its FLOPs.

cpu_causal.cpp is flash-style: a block of 32 query rows, with the query heads that share one
kv head stacked into its rows (96 for SmolLM2), walks the 64-key blocks up to its diagonal
with an online softmax; scores live one block at a time, every key block feeds all 96 rows
from registers, and one call serves every sequence of the step (no Python loop over
sequences). Its thread count is explicit, like cpu_paged's.

Built once per machine (engine/native.py); where it cannot be built, or for other dtypes or
head sizes, the torch backend keeps SDPA.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from inference_eval.engine import native


@functools.cache
def kernel():
    """The compiled module (its `causal_attention`), or None where it cannot be built."""
    return native.build(Path(__file__).with_suffix(".cpp"),
                        "fresh sequences use SDPA's causal mode instead")


def applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the kernel (built) serves these rows: fp32 on CPU, a head_dim it tiles, no
    autograd (the kernel has no backward)."""
    mod = kernel()
    return (mod is not None and q.device.type == "cpu" and q.dtype == k.dtype == torch.float32
            and q.shape[-1] % mod.head_dim_multiple == 0
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     threads: int = 1) -> torch.Tensor:
    """q [T, heads, d], k / v [T, kv_heads, d] fp32 packed rows, cu_seqlens [B + 1] int64
    (sequence b owns rows cu[b] .. cu[b + 1], row i of it sees its keys 0 .. i) ->
    [T, heads, d], softmax scale d^-0.5."""
    return kernel().causal_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens,
                                     q.shape[-1] ** -0.5, threads)
