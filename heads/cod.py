"""Conditional drop-token (COD) sampling: which positions a P-EAGLE training rollout runs at
each depth (head.cod_ratio, head.cod_ratio_min; PARD's sampling, which speculators' P-EAGLE
trainer uses).

Step 1 (the target's own features) runs at every position. Step k >= 2 runs at a random subset
S_k of the positions step k-1 ran at, so a position's keys at steps 2..k-1, which step k
attends to, always exist; S_k holds about N * max(cod_ratio^(k-1), cod_ratio_min) positions
(each S_{k-1} position is kept with probability ratio_k / ratio_{k-1}). Deeper steps thus
train on fewer positions: a K=8 rollout at cod_ratio 0.7 runs ~3.3 N rows instead of 8 N.
Each kept row is computed exactly as in the full rollout (tests/heads/test_cod.py), and each
step's loss is its mean over its kept rows, an unbiased estimate of the full step's.

The draw comes from PackedBatch.draw_seed (the micro-batch's own seed) so ranks, gradient
accumulation and resumed runs draw alike; validation (eval mode) runs every position.
"""
from __future__ import annotations

import torch

from heads.batch import PackedBatch


def retention(k: int, ratio: float, ratio_min: float) -> float:
    """The share of positions step k (1-based) runs at."""
    return 1.0 if k == 1 else max(ratio ** (k - 1), ratio_min)


def cod_rows(batch: PackedBatch, num_steps: int, ratio: float,
             ratio_min: float) -> list[torch.Tensor]:
    """[S_2, ..., S_K]: each an ascending int64 tensor of packed positions (on the batch's
    device), S_k a subset of S_{k-1} (S_1 = every position)."""
    n, dev = batch.input_ids.shape[0], batch.input_ids.device
    g = None  # the global generator, as a block's anchors without a seed
    if batch.draw_seed is not None:  # a stream apart from a block's anchors
        g = torch.Generator().manual_seed(batch.draw_seed ^ 0x5EED_C0D)
    rows, prev = [], torch.arange(n)
    for k in range(2, num_steps + 1):
        keep = retention(k, ratio, ratio_min) / retention(k - 1, ratio, ratio_min)
        prev = prev[torch.rand(prev.numel(), generator=g) < keep]
        rows.append(prev.to(dev))
    return rows
