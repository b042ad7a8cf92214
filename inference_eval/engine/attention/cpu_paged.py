"""A CPU kernel for decode-like steps: each request's few new rows attend over its own pages.

Decode, verification and draft steps (every request has at most SMALL_Q new rows, causal)
spent most of their attention time around SDPA rather than in it: one `index_select` per
layer copies every request's history into a [B, max_kv] batch padded to the longest, then
SDPA's CPU kernel runs per (request, head) with a mask. Measured on the 2-core EPYC, 1 thread,
64 requests of 40-400 keys (SmolLM2's 9 heads over 3 kv heads): gather 3.8 ms + SDPA 15.9 ms
per layer, for ~60 MFLOP. cpu_paged.cpp reads each key and value row once, straight from its
page, for all query heads that share it, and touches no padding: 5.2 ms on that 1 thread,
3.3 ms on 2 (SDPA alone on 2: 8.7 ms). It also appends the step's own rows to the cache.
Its thread count is the backend's, passed in: inside engine steps torch's own is 1 wherever
OpenBLAS runs products beside it (linear.openblas_threads).

Built once per machine (engine/native.py); where it cannot be built the torch backend keeps
its SDPA path and says why once.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from inference_eval.engine import native

# Up to this many new rows per request a step uses the kernel (a chunked prefill, with more,
# keeps SDPA: its rows share keys, which SDPA's blocked kernel turns into matrix products).
SMALL_Q = 8


@functools.cache
def kernel():
    """The compiled module (its `paged_attention`), or None where it cannot be built."""
    return native.build(Path(__file__).with_suffix(".cpp"),
                        "decode steps use SDPA over gathered pages instead")


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_q: torch.Tensor, kv_lens: torch.Tensor, page_size: int,
                    threads: int = 1) -> torch.Tensor:
    """Append k / v [T, kv_heads, d] at flat slots [T] of k_cache / v_cache [slots, kv_heads,
    d], then attend: q [T, heads, d] fp32, block_tables [B, max_pages] int64, cu_q [B + 1],
    kv_lens [B] -> [T, heads, d], query row i of a request with q_len rows seeing keys
    < kv_len - q_len + i + 1. threads: the kernel's own count (engine steps hold torch's at 1)."""
    return kernel().paged_attention(q.contiguous(), k.contiguous(), v.contiguous(), slots,
                                    k_cache, v_cache, block_tables, cu_q, kv_lens, page_size,
                                    q.shape[-1] ** -0.5, threads)
