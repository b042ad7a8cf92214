"""A CPU kernel for decode-like steps: each request's few new rows attend over its own pages.

Decode, verification and draft steps (every request has at most SMALL_Q new rows, causal, or
TREE_Q under a tree mask)
spent most of their attention time around SDPA rather than in it: one `index_select` per
layer copies every request's history into a [B, max_kv] batch padded to the longest, then
SDPA's CPU kernel runs per (request, head) with a mask. Measured on the 2-core EPYC, 1 thread,
64 requests of 40-400 keys (SmolLM2's 9 heads over 3 kv heads): gather 3.8 ms + SDPA 15.9 ms
per layer, for ~60 MFLOP. cpu_paged.cpp reads each key and value row once, straight from its
page, for all query heads that share it, and touches no padding: 5.2 ms on that 1 thread,
3.3 ms on 2 (SDPA alone on 2: 8.7 ms). It also appends the step's own rows to the cache.

Inside a task (a request's kv head, or some of its query rows) each query row scores blocks
of 8 keys at once (8 vector dot products folded together by reduce8, the products kernels'
lane sum), takes its softmax over keys in vectors, and sums its value rows in registers, up
to 4 rows sharing each value load. A row's sums run over its keys in key order, a key it may
not see adding an exact 0, so a verified row (causal, or a tree node whose ancestors sit
between their siblings) gets the floats of the one-row decode step at its position: greedy
speculation stays lossless to the bit (tested). At batch 1 the rows of a kv head split into
several tasks so that 3 kv heads keep 2 threads busy. Blocked this way, SmolLM2's layer at
256 cached keys takes about half the time of a loop with a dot product and a horizontal sum
per key and row (value sums in memory, softmax lanes over rows), 3-10% of a whole decode,
verification or tree step.

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

# Up to this many new rows per request a causal step uses the kernel (a chunked prefill, with
# more, keeps SDPA: its rows share keys, which SDPA's blocked kernel turns into matrix products).
SMALL_Q = 8
# Up to this many for a tree-masked step (EAGLE-2 verification and draft-tree levels), where
# SDPA needs a gathered, masked batch instead.
TREE_Q = 64
_NO_MASK = torch.empty(0, dtype=torch.long)


@functools.cache
def kernel():
    """The compiled module (its `paged_attention`), or None where it cannot be built."""
    return native.build(Path(__file__).with_suffix(".cpp"),
                        "decode steps use SDPA over gathered pages instead")


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_q: torch.Tensor, kv_lens: torch.Tensor, page_size: int,
                    threads: int = 1, masks: tuple | None = None) -> torch.Tensor:
    """Append k / v [T, kv_heads, d] at flat slots [T] of k_cache / v_cache [slots, kv_heads,
    d], then attend: q [T, heads, d] fp32, block_tables [B, max_pages] int64, cu_q [B + 1],
    kv_lens [B] -> [T, heads, d], query row i of a request with q_len rows seeing keys
    < kv_len - q_len + i + 1, or per tree_mask_tensors' `masks` where given.
    threads: the kernel's own count (engine steps hold torch's at 1)."""
    bits, off, width = masks if masks is not None else (_NO_MASK, _NO_MASK, _NO_MASK)
    return kernel().paged_attention(q.contiguous(), k.contiguous(), v.contiguous(), slots,
                                    k_cache, v_cache, block_tables, cu_q, kv_lens, page_size,
                                    q.shape[-1] ** -0.5, threads, bits, off, width)


def tree_mask_tensors(tree_masks: list[torch.Tensor | None]) -> tuple:
    """A layout's tree_masks (per request: bool [q_len, m] over its last m keys, or None for
    causal) -> the kernel's (uint8 bits, offsets [B], widths [B]; 0 = causal), built once per
    plan."""
    flat, off, width, at = [], [], [], 0
    for tm in tree_masks:
        off.append(at)
        width.append(0 if tm is None else tm.shape[1])
        if tm is not None:
            flat.append(tm.to(device="cpu", dtype=torch.uint8).reshape(-1))
            at += tm.numel()
    bits = torch.cat(flat) if flat else torch.zeros(1, dtype=torch.uint8)
    return bits, torch.tensor(off, dtype=torch.long), torch.tensor(width, dtype=torch.long)
